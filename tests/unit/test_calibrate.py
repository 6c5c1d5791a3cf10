"""`shardlm calibrate`'s measurements: units and magnitudes that a plan can use, written and read back."""

from shardlm import hardware
from shardlm.calibrate import calibrate, write_calibration


def test_calibration_measures_this_machine_and_round_trips(tmp_path):
    seen = []
    data = calibrate(seen.append)
    cpu = data["cpu"]
    assert seen == ["bandwidth", "flops", "layer_overhead_s", "runtime_bytes"]
    assert 1e9 < cpu["bandwidth"] < 1e12, "decode bandwidth in bytes/s: GB/s to TB/s on any CPU"
    assert 1e9 < cpu["flops"] < 1e14
    assert 1e-6 <= cpu["layer_overhead_s"] < 1e-2, "seconds per layer, not ms"
    assert 50 * 2**20 < cpu["runtime_bytes"] < 2 * 2**30, "a rank's Python + torch + buffers"
    write_calibration(data, tmp_path)
    assert hardware.read_calibration(tmp_path) == data
    spec = hardware.cpu_spec(2**30, data)
    assert spec.bandwidth == cpu["bandwidth"] and spec.source.startswith("calibrated")
