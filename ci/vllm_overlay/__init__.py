"""Tooling that turns a pinned vLLM release plus this project's patch series
into one wheel. build.sh calls the steps in order; see docs/architecture.md."""
