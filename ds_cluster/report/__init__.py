"""Floor 7, what users look at: a plan's summary and coverage (`summary`), its plots (`plots`) and the HTML
page (`page`). Reads what the other floors wrote; computes nothing of the plan again."""
