"""A scripted OpenAI-compatible judge for the tests of the ``judge`` reward: ``GET /v1/models``
and ``POST /v1/chat/completions``. It grades the way the tiny task's own reward does
(``digit_match`` of response and answer), read back from the user message that the template
``TEMPLATE`` wrote, and replies ``... Score: <grade>``. ``mode`` makes it misbehave: "garbage"
(a reply with no score), "flaky" (the first ``flaky_left`` requests answer 503), "hang" (every
request whose response holds ``hang_marker`` never answers); ``in_flight_max`` counts the most
requests it held at once."""

from __future__ import annotations

import re
import threading
import time

from megatron_gspo.rewards.functions import digit_match
from tests.support.json_http import JsonHandler, LocalServer

TEMPLATE = "Q:{prompt}|R:{response}|A:{answer}|"
_FIELDS = re.compile(r"Q:(.*)\|R:(.*)\|A:(.*)\|", re.DOTALL)


class JudgeServer:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.mode, self.flaky_left, self.hang_marker = "grade", 0, "\x00"
        self.delay_s, self.calls, self.in_flight, self.in_flight_max = delay_s, 0, 0, 0
        self.prompts: list[str] = []
        lock, server = threading.Lock(), self

        class Handler(JsonHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.send_json(200, {"object": "list", "data": [{"id": "judge"}]})

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.read_json()
                with lock:
                    server.calls += 1
                    server.in_flight += 1
                    server.in_flight_max = max(server.in_flight_max, server.in_flight)
                    flaky = server.flaky_left > 0
                    server.flaky_left -= flaky
                try:
                    self._answer(body, flaky)
                finally:
                    with lock:
                        server.in_flight -= 1

            def _answer(self, body: dict, flaky: bool) -> None:
                time.sleep(server.delay_s)
                if flaky:
                    self.send_json(503, {"error": "busy"})
                    return
                prompt, response, answer = _FIELDS.search(body["messages"][-1]["content"]).groups()
                server.prompts.append(prompt)
                if server.mode == "hang" and server.hang_marker in response:
                    time.sleep(3600)
                text = "I cannot grade this." if server.mode == "garbage" else (
                    f"Looks close. Score: 0.5\nFinal. Score: {digit_match(response, answer)!r}"
                )  # fmt: skip
                reply = {
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]
                }
                self.send_json(200, reply)

        self._server = LocalServer(Handler)
        self.url = f"{self._server.root}/v1"

    def close(self) -> None:
        self._server.close()
