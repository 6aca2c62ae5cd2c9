"""Ray orchestration: placement, actor groups, and engines, trainers and env workers as actors."""
