"""The test harness: the CPU test venv, the pytest plugin and runner for
upstream's tests, and the engine scenarios (the real Scheduler and ZMQ
publisher on the CPU). It may import the build line (vllm_overlay); the build
line never imports it."""
