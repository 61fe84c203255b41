"""The bottom layer every part of moe_rl may import, and which imports no part but `routing` (the route contract):
the batch types that travel from the rollout to the actor (`batch`), the collective helpers every part uses
(`distributed`), the error a setting that cannot run raises (`errors`), and which machine the config checks answer
for (`platform`)."""
