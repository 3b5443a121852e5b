"""The KV cache's bookkeeping: pages, their reference counts and the prefix cache."""
