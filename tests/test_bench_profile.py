"""bench.profile_attention on the CPU with a tiny shape: each peer's operator table, printed and written."""

from bench import profile_attention


def test_profile_lists_each_peers_operators(tmp_path, capsys):
    out = tmp_path / "profile.txt"
    profile_attention.main(
        [
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--n",
            "64",
            "--steps",
            "1",
            "--warmups",
            "0",
            "--rows",
            "4",
            "--peers",
            "long-short",
            "sdpa",
            "--out",
            str(out),
        ]
    )
    report = out.read_text()
    assert "== long-short, n = 64" in report and "== sdpa, n = 64" in report
    assert "aten::" in report  # the operators' rows
    assert "== sdpa" in capsys.readouterr().out
