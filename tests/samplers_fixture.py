"""A custom sampler the tests load into a controller by import path."""

from controllers import Sampler


class NewestFirst(Sampler):
    name = "newest_first"

    def sample(self, ready, batch_size, view, options, partial):
        if len(ready) < batch_size and not partial:
            return None
        return ready[::-1][:batch_size]
