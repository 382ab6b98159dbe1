"""nodeagent — the per-node daemon: stage weights in shm, keep slots warm and leased, activate them on request.

Two sides, one folder each:

- the daemon (this package's top level), in layers an import contract checks: `agent` (the composition and
  `run(settings, stop=...)`) over `requests` (subscribe, decode, admit, de-duplicate, reply), `activation`
  (activate and deactivate, fenced) and `prewarm` (stage, lock, arm, keep warm), over `slot` (a slot and the
  agent-side moves of one), over `vllm` and `served` (standby servers; their `serverspec`, `serverproc`,
  `enginelog`), over `staging` (copy, sha256, header checks; its `stagesource`, `shmbudget`, `weightlock` (mmap +
  mlock), `stagedfiles`, `stagedir`), `forked` (drives a slot's zygote), `readiness`, `metrics`, `settings`; and
  `rootfs` (with `imagetar`), `errors`, `cli`, `bench`, `preflight` (``agent --check``: `preflight_host`,
  `preflight_engine`, `preflight_base`);
- `engine/`: the code that runs inside the engine process: `zygote`, `pipe` (the typed messages between the agent
  and a zygote), `local` (a numpy model behind an OpenAI-shaped HTTP server), `loaders` (`host` now; GPU loaders
  in part 2), `safetensors_check` (pure header validation). An import contract keeps NATS, aiohttp,
  prometheus_client and the registry out of it.

`modelformat` (file names, manifest, config) is shared by both; `tinymodel` writes test models
(`pulsescale model make-tiny`).

Importing the package stays light on purpose: the zygote imports it, and nothing here may pull NATS or aiohttp
into the engine process.
"""

from nodeagent.errors import ActivationRefused, BadModel, BadWeights, EngineFailed, LoaderUnavailable, StagingFailed

__all__ = ["ActivationRefused", "BadModel", "BadWeights", "EngineFailed", "LoaderUnavailable", "StagingFailed"]
