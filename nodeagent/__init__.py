"""nodeagent — the per-node daemon: stage weights in shm, keep slots warm and leased, activate them on request.

Modules: `agent` (the daemon, `run(settings, stop=...)`), `settings`, `staging` (copy, sha256, header checks,
mmap + mlock), `safetensors_check` (pure header validation), `loaders` (`host` now; GPU loaders in part 2),
`engines` (adapters; `local` = a numpy model behind an OpenAI-shaped HTTP server, run by a pre-forked `zygote`),
`readiness`, `metrics`, `tinymodel` (`pulsescale model make-tiny`), `bench` (`pulsescale bench activate`), `cli`.

Importing the package stays light on purpose: the zygote imports it, and nothing here may pull NATS or aiohttp
into the engine process.
"""

from nodeagent.errors import ActivationRefused, BadModel, BadWeights, EngineFailed, LoaderUnavailable, StagingFailed

__all__ = ["ActivationRefused", "BadModel", "BadWeights", "EngineFailed", "LoaderUnavailable", "StagingFailed"]
