"""Test rigs: real processes and workloads for the tests, the demo, the bench and the soak.

Everything here is real and local (real parts, not mocks), started and stopped by pid:

* :mod:`.processes`: :class:`~.processes.ChildProcess`, the one way a rig starts a child, waits for its
  ready line and stops it; :func:`~.processes.freeze` / :func:`~.processes.thaw` hang and resume one;
* :mod:`.master`: :class:`~.master.EmbeddedMaster`, a real ``mooncake_master`` on 127.0.0.1;
* :mod:`.server_process`: :class:`~.server_process.ServerProcess`, lookup servers (ours, vLLM's or both)
  in a child process that can be killed, hung and restarted on the same address;
* :mod:`.faults`: the one injected fault, a slow but healthy store;
* :mod:`.soak`: :class:`~.soak.FaultRig` and :func:`~.soak.run_soak`, the lookup path under random real faults;
* :mod:`.machine`: the machine, load average, date, commit and versions a measurement ran with;
* :mod:`.scheduler_driver`: vLLM's real V1 scheduler on CPU, stepped by hand;
* :mod:`.workload`: deterministic shared-prefix requests;
* :mod:`.vllm_lookup_server`: vLLM's own ``LookupKeyServer`` over a prefix index;
* :mod:`.rpc_base_path`: the one place that sets ``VLLM_RPC_BASE_PATH`` (in this process; an
  :class:`~.engine.Engine` sets it in its own child's environment);
* :mod:`.engine`: :class:`~.engine.Engine`, a real ``vllm serve`` on CPU from the engine venv;
  :mod:`.tiny_model`: its model and tokenizer, made locally; :mod:`.segment_owner`: memory for the store.

The runtime never imports this package. Modules are imported on use (some import vLLM).
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"ChildProcess": "processes", "EmbeddedMaster": "master", "Engine": "engine", "FaultRig": "soak",
          "InjectedDelayBackend": "faults", "SegmentOwner": "segment_owner",
          "MasterError": "master", "SchedulerDriver": "scheduler_driver", "ServerProcess": "server_process",
          "UpstreamLookupServer": "vllm_lookup_server", "WorkloadRequest": "workload", "run_soak": "soak",
          "shared_prefix_workload": "workload"}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562), so importing the package stays cheap."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = sorted(_HOMES)
