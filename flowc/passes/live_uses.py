"""Uses of a graph's values kept up to date through a pass's rewrites, dead nodes dropped
from them as they die, so that a pattern pass (fuse_gemm, fuse_attention) sees after each
match the uses that ``graph.remove_unused()`` and a fresh ``graph.users()`` would give,
without paying for both over the whole graph per match (quadratic on a deep model).

Dead nodes stay in ``graph.nodes`` until ``finish()`` removes them all at once; ``alive``
is the set of nodes still in the graph as far as the pass is concerned.
"""

from __future__ import annotations

from flowc.ir.graph import Graph, Node, Value


class LiveUses:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.outs = graph.kept()
        self.changed = False
        self._reset()

    def _reset(self) -> None:
        self.users: dict[Value, list[Node]] = self.graph.users()
        self.alive: set[Node] = set(self.graph.nodes)

    def used(self, v: Value) -> bool:
        return v in self.outs or bool(self.users.get(v))

    def add(self, node: Node) -> None:
        """``node`` is in the graph now: count its uses."""
        self.alive.add(node)
        for i in node.inputs:
            if i is not None:
                self.users.setdefault(i, []).append(node)

    def move_uses(self, old: Value, new: Value) -> None:
        """Record ``graph.replace_uses(old, new)`` (done by the caller)."""
        moved = self.users.pop(old, [])
        self.users.setdefault(new, []).extend(moved)
        self.users[old] = []

    def drop(self, node: Node) -> None:
        """``node`` is gone (replaced, or dead): forget its uses, and drop the producers that
        had no other use, transitively."""
        work = [node]
        while work:
            n = work.pop()
            if n not in self.alive:
                continue
            self.alive.discard(n)
            for i in n.inputs:
                if i is None:
                    continue
                us = self.users.get(i)
                if us is not None and n in us:
                    us.remove(n)
                p = i.producer
                if p is not None and p in self.alive and not any(self.used(o) for o in p.outputs):
                    work.append(p)

    def matched(self) -> None:
        """A rewrite happened. The first one also drops what was dead before the pass (as the
        remove_unused after it always did), so that every later match sees exact uses."""
        if not self.changed:
            self.changed = True
            self.graph.remove_unused()
            self._reset()

    def finish(self) -> None:
        """Remove the dead nodes (and unread constants) from the graph, once."""
        if self.changed:
            self.graph.remove_unused()
