"""What the carve tests carve: the bundled tiny-moe-draft (a real trained Llama with a
tokenizer), with calibration settings small enough for a test."""

DRAFT = "tiny-moe-draft"
FAST = dict(calibration_windows=6, window=64, cluster_tokens=256, cluster_iterations=3)
