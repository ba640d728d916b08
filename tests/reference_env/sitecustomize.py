"""Imported at interpreter start-up by the plain-torchrun reference runs of the integration tests (their
PYTHONPATH starts with this folder; see test_integration_common.torchrun): installs hfzero's exit hook
against gloo's teardown abort (see [Note: gloo teardown abort] in hfzero/comm/gloo_exit.py), which a plain
DDP worker hits too ("terminate called without an active exception", 2 in 32 runs measured), and keeps the
process group past ``destroy_process_group`` (``trainer.end()`` in TRL's scripts) so that DDP's reducer never
destroys it at the script's end (a deadlock seen once in TRL's DPO script under torch 2.14.1). The scripts
themselves stay free of hfzero; the `hfzero run` side installs the hook with its first communicator."""

import functools

import torch.distributed as dist

from hfzero.comm import gloo_exit

gloo_exit.install()


def _keeping_the_group(destroy):
    """``destroy_process_group`` that first hands the group to ``gloo_exit.keep``: DDP's reducer then never holds
    the last reference when the script drops it (the hang of [Note: gloo teardown abort])."""

    @functools.wraps(destroy)
    def wrapper(group=None, *args, **kwargs):
        if dist.is_initialized():
            gloo_exit.keep(group if group is not None else dist.group.WORLD)
        return destroy(group, *args, **kwargs)

    return wrapper


dist.destroy_process_group = _keeping_the_group(dist.destroy_process_group)
