"""The takeover planner: who processes which rows of a step, and the role each slice plays."""
