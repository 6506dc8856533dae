"""Graph passes, one module each, registered by name, runnable alone and timed."""

from flowc.passes.manager import PASSES, PassManager, register_pass

__all__ = ["PASSES", "PassManager", "register_pass"]
