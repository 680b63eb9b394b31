"""Checkpoints of format versions 1 and 2 (written before placements named every saved piece) read as SavedTables:
their layout fields ("tp", "pp", "ep", per-stage sections, expert chunks' "ep_members") turned into saved chunks with
the files of their shards, as those versions laid them out."""

from __future__ import annotations

from engine.checkpoint_tables import SavedChunk, SavedTables

STAGE_VERSION = 2  # per-stage sections, lists by pipeline rank; version 1: one section


def legacy_tables(manifest: dict) -> SavedTables:
    layout, sections = manifest["layout"], manifest["version"] == STAGE_VERSION

    def stages(key: str) -> list:
        return manifest[key] if sections else [manifest[key]]

    file_of = {(f.get("pp_rank", 0), f["dp_rank"], f["tp_rank"]): f["name"] for f in manifest["files"]}
    shard_count, expert_groups = layout["shard_count"], layout.get("ep", 1)
    tables = SavedTables(parts={key: stages(key) for key in ("param_groups", "lr_scheduler")}, cut_size=layout["tp"],
                         sizes={"world": layout["world_size"], "tp": layout["tp"], "pp": layout.get("pp", 1)})
    for pp, (chunks_of, extras_of) in enumerate(zip(stages("chunks"), stages("extras"))):
        for tp, chunks in chunks_of.items():
            tp = int(tp)
            for i, chunk in enumerate(chunks):
                if not chunk.get("expert"):
                    files = tuple(file_of[(pp, d, tp)] for d in range(shard_count))
                    tables.add_chunk(SavedChunk(f"chunk.{i}", chunk["numel"], files), tp, chunk["members"])
                    continue
                for ep, members in enumerate(chunk["ep_members"]):  # shard d of ep rank e: dp rank d·ep + e's file
                    files = tuple(file_of[(pp, d * expert_groups + ep, tp)] for d in range(chunk["shards"]))
                    tables.add_chunk(SavedChunk(f"chunk.{i}", chunk["numel"], files), tp, members)
        for tp, entries in extras_of.items():
            tables.add_extras(int(tp), entries, file_of[(pp, 0, int(tp))])
    return tables
