/* The library's operators: each kernel's table of code paths (variants) and the registry that the ONNX Runtime glue
 * (ort_custom_op.c) and Python (cvl_op_variant) read. An operator adds itself with CVL_REGISTER_OP in its own file
 * (the kit's in service/engine/native, a family's fused layers in service/layers/native): nothing here names one. */
#ifndef COSYVOICE_LITE_OP_H
#define COSYVOICE_LITE_OP_H

#include <stdint.h>

#include "cpu.h"

/* One code path of a kernel and the CPU features it needs; variants[0] is the portable C (needs 0), the reference
 * every other variant is tested against (tests/native). */
typedef struct {
    const char* name;
    cvl_features needs;
} cvl_variant;

typedef struct {
    const cvl_variant* variants; /* in order of preference, lowest first */
    int count;
    /* The variant the kernel takes with features `have` for a head size `head_dim` (0: any); NULL: the last one whose
     * needs `have` holds. */
    int (*pick)(cvl_features have, int64_t head_dim);
} cvl_variants;

/* The index of the variant `v` takes with `have` (and `head_dim`, for kernels that depend on it). */
int cvl_pick_variant(const cvl_variants* v, cvl_features have, int64_t head_dim);

struct OrtCustomOp;

/* A registered operator: its op type in the cosyvoice_lite domain, its variants, its ONNX Runtime custom operator. */
typedef struct {
    const char* name;
    const cvl_variants* variants;
    const struct OrtCustomOp* ort;
} cvl_op;

/* Registers `op` (a cvl_op with static storage) by a pointer in the linker section cvl_ops, which the linker bounds
 * with __start_cvl_ops and __stop_cvl_ops. */
#define CVL_REGISTER_OP(op) \
    static const cvl_op* const cvl_registered_##op __attribute__((used, section("cvl_ops"), aligned(sizeof(void*)))) = &op

/* The registered operators: count, the i-th one, or the one named `name` (NULL when none). */
int cvl_op_count(void);
const cvl_op* cvl_op_at(int i);
const cvl_op* cvl_op_named(const char* name);

/* The name of the variant operator `name` takes under features `have` (cvl_isa_features) for head size `head_dim`;
 * NULL for an unknown operator. Python's probe (service/engine/native.py). */
const char* cvl_op_variant(const char* name, cvl_features have, int64_t head_dim);

/* Variant `i` of operator `name`: its name, and what it needs in *needs; NULL past the table or for an unknown one. */
const char* cvl_op_variant_at(const char* name, int i, cvl_features* needs);

#endif
