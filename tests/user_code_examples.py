"""The texts of a user's env and estimator, written to temporary files by the tests of
``env.name`` / ``algo.adv_estimator`` given as code paths (tests/test_train_e2e.py)."""

#: a one-turn game: "Left" wins 1, "Right" 0, anything else is an invalid action
USER_ENV = r'''
from ragen_mega.envs.base import TextEnv, invalid_action_info


class Coin(TextEnv):
    seed_shared_in_group = False

    def __init__(self, prize: float = 1.0, log: str = ""):
        self.prize, self.log = prize, log

    def reset(self, seed):
        if self.log:  # the test's evidence that the run played this game
            with open(self.log, "a") as f:
                f.write(f"{seed}\n")
        return f"Coin {seed}: say Left or Right."

    def step(self, action):
        word = action.strip().lower()
        if word not in ("left", "right"):
            return "Coin: done.", 0.0, True, invalid_action_info("not a side")
        win = word == "left"
        return ("Coin: done.", self.prize if win else 0.0, True,
                {"action_is_valid": True, "action_is_effective": True, "success": win})

    @property
    def instruction(self):
        return "Pick a side of the coin."

    @property
    def valid_actions(self):
        return ["Left", "Right"]
'''

#: every response token's advantage is CREDIT: the loss then is exactly -CREDIT on the first
#: update (ratio 1), whatever the model sampled
CREDIT = 0.375
USER_ESTIMATOR = f'''
import torch

from ragen_mega.algo.estimators import estimator


@estimator("constant_credit", critic="forbidden", group_relative=True,
           credit="every token the same credit")
def constant_credit(batch, settings, *, token_values=None, bootstrap_values=None):
    batch["advantages"] = {CREDIT} * batch["loss_mask"].to(torch.float32)
    return batch
'''
