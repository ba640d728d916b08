"""ZeRO stage 3 (P_os+g+p): parameters partitioned and gathered per unit around their use.

Files, one concept each: units.py (which modules are units), unit.py (one unit's shard lifecycle),
scheduler.py (hooks, prefetch, gather order), engine.py (the engine), state_dict.py (full state dicts).
"""

from hfzero.runtime.stage3.engine import Stage3Engine
from hfzero.runtime.stage3.scheduler import GatherOrderError, Phase, UnitScheduler
from hfzero.runtime.stage3.state_dict import full_state_dict
from hfzero.runtime.stage3.unit import GatherUnit, UnitState
from hfzero.runtime.stage3.units import default_unit_names, resolve_units

__all__ = ["GatherOrderError", "GatherUnit", "Phase", "Stage3Engine", "UnitScheduler", "UnitState",
           "default_unit_names", "full_state_dict", "resolve_units"]
