"""The hfzero dashboard: a Streamlit app that browses profile run directories.

``data`` loads runs (through ``hfzero.profiler.reader`` only) into plain tables, ``figures`` builds
plotly figures from them, ``estimator`` computes the paper's Table 1 layout, ``pages`` wires them
into Streamlit views and ``app`` is the entry point that ``hfzero dashboard`` starts. Everything but
``pages`` and ``app`` runs without Streamlit. See ``docs/dashboard.md``.
"""
