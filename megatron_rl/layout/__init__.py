"""Layout sizes and the rules a layout must satisfy, shared by validation, resolution and the planner."""
