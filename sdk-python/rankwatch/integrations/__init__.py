"""Framework integrations, each imported only when used (their frameworks stay optional):

* `rankwatch.integrations.transformers.RankwatchCallback` — a Hugging Face `TrainerCallback`;
* `rankwatch.integrations.lightning.RankwatchCallback` — a Lightning `Callback`.
"""
