"""The committed model family and what trains and tunes models for it.

`zoo` builds, trains and loads the family (`family/`); `head_training` trains feature heads;
`tune` runs offline Optuna studies per request class.
"""
