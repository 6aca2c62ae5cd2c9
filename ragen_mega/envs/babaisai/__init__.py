"""BabaIsAI: Baba Is You puzzles whose rules are word blocks on the grid, as a text env.

``grid`` is the engine (stacks, rule reading, pushes, transforms), ``levels`` the 40 task
generators of BALROG's list, ``text_view`` the observation text, ``env`` the :class:`TextEnv`.
"""
