"""``kvwire bench serve``'s in-serving transfer summary: percentiles per side, the sender's wire GB/s
(bytes over the plane's busy time) and its ratio to a ceiling measured on the median bytes."""

from __future__ import annotations

import pytest

from kvwire.bench import serve_transfers


def test_summary_uses_busy_time_for_the_wire_and_the_median_bytes_for_the_ceiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[int] = []

    def ceiling(num_bytes: int, repeats: int = 5) -> float:
        seen.append(num_bytes)
        return 4.0

    monkeypatch.setattr(serve_transfers, "socket_ceiling_gbps", ceiling)
    rows: dict[str, list[serve_transfers.Row]] = {
        # 1 GB each: 1 s end to end but the plane busy 0.5 s -> 1 GB/s end to end, 2 GB/s on the wire
        "send": [(10**9, 1.0, 0.5), (10**9, 2.0, 0.25), (3 * 10**9, 3.0, 1.0)],
        "recv": [(10**9, 0.5, None), (10**9, 0.5, None), (3 * 10**9, 1.0, None)],
    }
    out = serve_transfers.summarize(rows, with_ceiling=True)
    assert out["count"] == 3 and out["median_bytes"] == 10**9 and seen == [10**9]
    assert out["wire_gbps"] == {"p50": 3.0, "p90": 4.0}  # 2, 3, 4 GB/s
    assert out["send_gbps"]["p50"] == 1.0 and out["recv_gbps"]["p50"] == 2.0
    assert out["wire_ratio_p50"] == 3.0 / 4.0
    assert "wire 3.00/4.00" in serve_transfers.describe(out)


def test_no_transfers_says_so() -> None:
    out = serve_transfers.summarize({"send": [], "recv": []}, with_ceiling=True)
    assert serve_transfers.describe(out) == "in-serving KV transfer: none recorded"


def test_device_copies_are_summed_from_the_instances_metrics_and_reported_as_one_rate() -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    bodies = [
        b"kvwire_kv_device_copy_bytes_total 3e+09\nkvwire_kv_device_copy_seconds_total 0.002\n",
        b"kvwire_kv_device_copy_bytes_total 1e+09\nkvwire_kv_device_copy_seconds_total 0.002\n",
    ]

    def server(body: bytes) -> HTTPServer:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        srv = HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv

    servers = [server(b) for b in bodies]
    try:
        urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers] + ["http://127.0.0.1:9"]
        copied = serve_transfers.device_copies(urls)  # the last one answers nothing: skipped
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
    assert copied == (4e9, 0.004)
    out = serve_transfers.summarize({"send": [(10**9, 1.0, 0.5)], "recv": []}, False, copied)
    assert out["device_copy_gbps"] == 1000.0
    assert "device copies 1000 GB/s (bytes / copy windows on the GPU)" in serve_transfers.describe(out)
    assert "device_copy_gbps" not in serve_transfers.summarize({"send": [], "recv": []}, False)


def test_exposed_handover_percentiles_and_share_of_ttft(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"http://d": {"send": [], "recv": [], "exposed": [0.002, 0.004, 0.006, "x"]},
               "http://p": {"send": [], "recv": []}}  # P reports none; a bad value is skipped

    def fake(url: str, timeout_s: float) -> dict:
        if url.startswith("http://gone"):
            raise OSError("refused")
        return answers[url.removesuffix("/kvwire/transfers")]

    monkeypatch.setattr(serve_transfers, "http_json", fake)
    out = serve_transfers.exposed_handover(["http://d", "http://p", "http://gone"], [0.01, 0.02, 0.04])
    assert out["count"] == 3 and out["p50_s"] == 0.004 and out["p99_s"] == 0.006
    assert out["share_of_ttft_p50"] == pytest.approx(0.2)
    assert "p50 4.00 ms" in serve_transfers.describe_handover(out)
    assert serve_transfers.exposed_handover(["http://p"], [0.01]) == {"count": 0}


def test_handover_to_step_and_a_mark_leave_out_the_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lists are oldest first: what a mark saw (the warm-up's transfers: first launches, first
    allocations) is left out; ``exposed_to_step`` adds the wait for D's next engine step."""
    answers = {"http://d": {"send": [], "recv": [[10, 9.0, None], [10, 1.0, None]],
                            "exposed": [5.0, 0.002, 0.004], "exposed_to_step": [6.0, 0.010, 0.020]}}

    def fake(url: str, timeout_s: float) -> dict:
        return answers[url.removesuffix("/kvwire/transfers")]

    monkeypatch.setattr(serve_transfers, "http_json", fake)
    marked = {"http://d": {"send": 0, "recv": 1, "exposed": 1, "exposed_to_step": 1}}
    out = serve_transfers.exposed_handover(["http://d"], [0.1], since=marked)
    assert out["count"] == 2 and out["p99_s"] == 0.004  # 5.0 s was the warm-up's
    assert out["to_step_p50_s"] == 0.020 and out["to_step_share_of_ttft_p50"] == pytest.approx(0.2)
    assert "to D's next engine step p50 20.00 ms" in serve_transfers.describe_handover(out)
    assert serve_transfers.collect(["http://d"], since=marked)["recv"] == [(10, 1.0, None)]
    assert serve_transfers.mark(["http://d"]) == {"http://d": {"send": 0, "recv": 2, "exposed": 3,
                                                               "exposed_to_step": 3}}
    assert serve_transfers.exposed_handover(["http://d"], [0.1])["p99_s"] == 5.0  # no mark: all


def test_warm_up_prompts_are_not_the_timed_ones_and_the_timed_ones_follow_the_seed() -> None:
    """A warm-up that reused the first timed prompts made those requests prefix-cache hits."""
    import argparse

    from kvwire.bench.serve import make_load

    def load(warmup: int) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        args = argparse.Namespace(num_prompts=4, input_len=16, output_len=4, seed=3, request_rate=2.0,
                                  arrival="poisson", model="tiny", max_concurrency=0, timeout_s=5.0,
                                  warmup=warmup)
        spec = make_load(args)
        return spec.prompts, spec.warmup_prompts

    timed, warm = load(2)
    assert len(warm) == 2 and not set(warm) & set(timed)
    assert load(0) == (timed, ())  # the warm-up count does not change the timed prompts
