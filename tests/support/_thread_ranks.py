"""Simulated data-parallel ranks for the pure algorithm tests: threads with a summing all_reduce."""
import threading


def thread_ranks(fns):
    """Run fns[k](all_reduce) for k = 0..n-1 in n threads; all_reduce sums over the threads."""
    n = len(fns)
    barrier = threading.Barrier(n, timeout=20)
    slots: list = [None] * n
    results: list = [None] * n
    errors: list = []

    def make_all_reduce(rank):
        def all_reduce(t):
            slots[rank] = t.detach().clone()
            barrier.wait()
            total = slots[0].clone()
            for s in slots[1:]:
                total = total + s
            barrier.wait()  # everyone has read the slots before anyone overwrites them
            return total
        return all_reduce

    def body(rank):
        try:
            results[rank] = fns[rank](make_all_reduce(rank))
        except BaseException as e:  # pragma: no cover - surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
