"""``AccumulationWindows.state_dict(ahead=n)``: the position before the last ``n`` micro-batches
handed out (those a trainer fetched ahead and has not trained; Lightning holds one). It must
equal the state taken when only the earlier ones had been handed out, counters and the loader's
position alike, also when the handed-back micro-batches span windows (P4 across a resume)."""

from __future__ import annotations

import pytest
from torch_support import ToyDataset

from odb_torch import ODBDataLoader
from odb_torch.windows import AccumulationWindows

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_state_before_the_last_n_handed_out_equals_the_state_taken_then(k):
    loader = ODBDataLoader(ToyDataset(40), token_budget=64, rank=0, world_size=1, num_workers=0, buffer_size=4)
    try:
        windows = AccumulationWindows(loader, k)
        then = {0: windows.state_dict()}
        for handed, _ in enumerate(windows, start=1):
            then[handed] = windows.state_dict()  # the position once `handed` micro-batches are out
            if handed == 8:
                break
        for ahead in range(0, 6):
            got, want = windows.state_dict(ahead=ahead), then[8 - ahead]
            assert {key: v for key, v in got.items() if key != "loader"} == \
                   {key: v for key, v in want.items() if key != "loader"}, (k, ahead)
            assert (sorted(got["loader"]["consumed"]), got["loader"]["steps"]) == \
                   (sorted(want["loader"]["consumed"]), want["loader"]["steps"]), (k, ahead)
        with pytest.raises(ValueError, match="ahead"):
            windows.state_dict(ahead=9)
    finally:
        loader.close()
