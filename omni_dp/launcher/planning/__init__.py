"""Pure planning: `omni-dp launch`'s options and the machine's facts in, a validated LaunchPlan (or
every problem at once) out. Nothing here starts, signals or writes anything.
"""
