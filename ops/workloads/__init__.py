"""Tuning non-LLM workloads: request-size traffic, the two tiers, paired comparison with static-best, the choice."""
