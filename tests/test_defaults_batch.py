"""The shipped defaults batch: concurrent requests are decoded together, not one after another."""

from __future__ import annotations

import threading
from pathlib import Path

from fastapi.testclient import TestClient

from service.api.app import create_app
from service.settings import Settings

TEXT = "今天天气很好，我们一起去公园散步吧，然后看一场电影，再一起回家吃晚饭。"


def test_default_settings_decode_concurrent_requests_together(tiny_bundle: Path) -> None:
    settings = Settings(_env_file=None, model_dir=tiny_bundle)  # type: ignore[call-arg]
    app = create_app(settings)
    clients = 4
    start = threading.Barrier(clients)
    statuses: list[int] = []

    def call(seed: int) -> None:
        start.wait()
        response = client.post("/tts", json={"text": TEXT, "seed": seed, "format": "pcm"})
        statuses.append(response.status_code)

    with TestClient(app) as client:
        threads = [threading.Thread(target=call, args=(seed,)) for seed in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        service = app.state.tts.service
        scheduler = app.state.tts.runtime.model.engine.scheduler  # the CosyVoice-300M model's synthesizer
        assert service.concurrency == settings.concurrent_requests > 1
        assert scheduler is not None, "the default engine has a batching scheduler"
        stats = scheduler.stats
    assert statuses == [200] * clients
    assert stats.max_rows > 1, f"requests were decoded one at a time (max rows {stats.max_rows})"
    assert stats.mean_batch > 1.0
