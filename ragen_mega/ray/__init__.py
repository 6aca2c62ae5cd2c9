"""Ray orchestration: placement, actor groups, engines and trainers as Ray actors, the driver loop."""
