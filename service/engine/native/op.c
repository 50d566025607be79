/* The operator registry (op.h): the pointers every CVL_REGISTER_OP put in the linker section cvl_ops. */

#include "op.h"

#include <string.h>

/* Defined by the linker around the section (it has at least one entry: the kit registers its own operators). */
extern const cvl_op* const __start_cvl_ops[];
extern const cvl_op* const __stop_cvl_ops[];

int cvl_pick_variant(const cvl_variants* v, cvl_features have, int64_t head_dim) {
    if (v->pick != NULL) return v->pick(have, head_dim);
    int chosen = 0;
    for (int i = 0; i < v->count; i++)
        if (cvl_has(have, v->variants[i].needs)) chosen = i;
    return chosen;
}

int cvl_op_count(void) { return (int)(__stop_cvl_ops - __start_cvl_ops); }

const cvl_op* cvl_op_at(int i) { return i >= 0 && i < cvl_op_count() ? __start_cvl_ops[i] : NULL; }

const cvl_op* cvl_op_named(const char* name) {
    for (int i = 0; i < cvl_op_count(); i++)
        if (strcmp(__start_cvl_ops[i]->name, name) == 0) return __start_cvl_ops[i];
    return NULL;
}

const char* cvl_op_variant(const char* name, cvl_features have, int64_t head_dim) {
    const cvl_op* op = name != NULL ? cvl_op_named(name) : NULL;
    if (op == NULL) return NULL;
    return op->variants->variants[cvl_pick_variant(op->variants, have & cvl_cpu_features(), head_dim)].name;
}

const char* cvl_op_variant_at(const char* name, int i, cvl_features* needs) {
    const cvl_op* op = name != NULL ? cvl_op_named(name) : NULL;
    if (op == NULL || i < 0 || i >= op->variants->count) return NULL;
    *needs = op->variants->variants[i].needs;
    return op->variants->variants[i].name;
}
