/* engram_runtime.h: the process's kernel runtime (engram_isa.h es_runtime), compiled into its
 * owner alone, engram_stream._hash, which hands it to every other extension at import. */
#ifndef ENGRAM_RUNTIME_H
#define ENGRAM_RUNTIME_H

#include "engram_isa.h"
#include "engram_step.h"

static const es_runtime es_runtime_own = {
    es_own_isa_now,   es_own_isa_set,   es_own_isa_call, es_own_isa_force, es_own_isa_forced,
    es_own_team_open, es_own_team_close, es_own_team_keep, es_own_team_put, es_own_team_slots_held,
};

#endif /* ENGRAM_RUNTIME_H */
