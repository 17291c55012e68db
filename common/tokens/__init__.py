"""Token sequences without torch: incremental detokenization and n-gram lookup."""
