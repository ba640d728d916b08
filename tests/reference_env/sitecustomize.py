"""Imported at interpreter start-up by the plain-torchrun reference runs of the integration tests (their
PYTHONPATH starts with this folder; see test_integration_common.torchrun): installs hfzero's exit hook
against gloo's teardown abort (see [Note: gloo teardown abort] in hfzero/comm/gloo_exit.py), which a plain
DDP worker hits too ("terminate called without an active exception", 2 in 32 runs measured). The scripts
themselves stay free of hfzero; the `hfzero run` side installs the hook with its first communicator."""

from hfzero import gloo_exit

gloo_exit.install()
