"""bench/hf_load.py's arithmetic: the slowest rank per load, the warm-up left out of the medians,
each rank's bytes against the whole checkpoint, and the goals judged from those figures."""

from __future__ import annotations

from bench.hf_load import summarize

TOTAL = 1000


def loads(disk: list[tuple[float, float]], s3: list[tuple[float, float]], reference: list[float]) -> dict:
    """Per load, each rank's (seconds, bytes read, bytes total); the first load is the warm-up."""

    def ranks(times: tuple[float, float], read: tuple[int, int]) -> dict:
        return {rank: (seconds, bytes_read, TOTAL) for rank, (seconds, bytes_read) in enumerate(zip(times, read))}

    return {
        "ours_disk": [ranks(times, (500, 520)) for times in disk],
        "ours_s3": [ranks(times, (550, 650)) for times in s3],
        "transformers": [{0: (seconds, 0, 0)} for seconds in reference],
    }


def test_the_slowest_rank_counts_and_the_warm_up_does_not():
    disk = [(9.0, 9.0), (0.1, 0.3), (0.2, 0.1), (0.5, 0.1)]
    s3 = [(9.0, 9.0)] + [(0.8, 0.6)] * 3
    figures = summarize(loads(disk, s3, reference=[9.0, 0.4, 0.4, 0.4]), quick=True, params=500, files=["a", "b"])
    assert figures["load_s"] == {"ours_disk": 0.3, "ours_s3": 0.8, "transformers": 0.4}
    assert figures["first_load_s"] == {"ours_disk": 9.0, "ours_s3": 9.0, "transformers": 9.0}
    assert figures["rounds"]["ours_disk"] == [0.3, 0.2, 0.5]
    assert (figures["load_ratio_disk_vs_transformers"], figures["load_ratio_s3_vs_transformers"]) == (0.75, 2.0)
    assert figures["bytes_fraction_per_rank"] == {"ours_disk": [0.5, 0.52], "ours_s3": [0.55, 0.65]}
    assert figures["goals_met"] == {
        "load_disk_vs_transformers<=1x": True,
        "load_s3_vs_transformers<=1x": False,
        "bytes_per_rank<=0.6_of_total": False,  # one rank of one source over the bound fails it
    }
