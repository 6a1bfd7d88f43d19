"""The search: its configuration and workers, the board, the agents that propose, the tuner, its report,
progress and plots."""
