"""Episodes: a prompt, model turns, environment turns, and what the update makes of them.

- :mod:`.episode`: the token sequence with its per-token mask, turns and turn rewards;
- :mod:`.environment`: the environment protocol, built-ins, and its worker processes;
- :mod:`.render`: an environment turn as token ids (chat-template glue);
- :mod:`.runner`: running a batch of episodes turn by turn through an engine;
- :mod:`.sampling`: how the loop samples a step's episodes;
- :mod:`.scoring`: rewards, failed scores, credit (advantages), metrics: episodes to samples.
"""
