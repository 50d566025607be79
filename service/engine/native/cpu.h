/* The one CPU feature probe every kernel and service/engine/native.py read, and the ISA ceilings an option may set. */
#ifndef COSYVOICE_LITE_CPU_H
#define COSYVOICE_LITE_CPU_H

#include <stdint.h>

/* One bit per instruction-set feature the kernels choose by; the names are Linux's /proc/cpuinfo flags. */
typedef uint32_t cvl_features;
enum {
    CVL_AVX2 = 1u << 0,
    CVL_FMA = 1u << 1,
    CVL_F16C = 1u << 2,
    CVL_AVX512F = 1u << 3,
    CVL_AVX512BW = 1u << 4,
    CVL_AVX512VL = 1u << 5,
    CVL_AVX512_VNNI = 1u << 6,
    CVL_AVX512_BF16 = 1u << 7,
    CVL_AMX_TILE = 1u << 8, /* the AMX bits only where Linux granted this process the tile data */
    CVL_AMX_INT8 = 1u << 9,
    CVL_AMX_BF16 = 1u << 10,
};
#define CVL_FEATURE_COUNT 11
#define CVL_AMX_ANY (CVL_AMX_TILE | CVL_AMX_INT8 | CVL_AMX_BF16)

/* The host's features: CPUID, with XGETBV for the register state the OS saves (AVX, AVX-512, AMX tiles), and for AMX
 * the Linux permission (arch_prctl ARCH_REQ_XCOMP_PERM, requested once). Probed once, when the library loads. */
cvl_features cvl_cpu_features(void);

/* The flag name of feature bit `bit` (0 .. CVL_FEATURE_COUNT - 1), or NULL. */
const char* cvl_feature_name(int bit);

/* Ceilings on the code a kernel may take (TTS_NATIVE_KERNELS): every variant the CPU has, everything but AMX tiles, or
 * the portable C only. */
typedef enum { CVL_ISA_PORTABLE = 0, CVL_ISA_NO_AMX = 1, CVL_ISA_AUTO = 2 } cvl_isa;

/* The host's features a kernel may use under `ceiling`. */
cvl_features cvl_isa_features(cvl_isa ceiling);

/* The ceiling named "portable", "no-amx" or "auto"; -1 for any other name. */
int cvl_isa_parse(const char* name);

static inline int cvl_has(cvl_features have, cvl_features needs) { return (have & needs) == needs; }

/* What each code path needs (each kernel's variant table lists them). */
#define CVL_NEEDS_AVX2 (CVL_AVX2 | CVL_FMA | CVL_F16C)
#define CVL_NEEDS_AVX512_VNNI (CVL_AVX512F | CVL_AVX512BW | CVL_AVX512VL | CVL_AVX512_VNNI)
#define CVL_NEEDS_AVX512_BF16 (CVL_AVX512F | CVL_AVX512BW | CVL_AVX512VL | CVL_AVX512_BF16 | CVL_FMA | CVL_F16C)
#define CVL_NEEDS_AMX (CVL_AVX512F | CVL_AVX512BW | CVL_AVX512VL | CVL_AVX512_VNNI | CVL_AVX512_BF16 | CVL_AMX_TILE)
#define CVL_NEEDS_AMX_INT8 (CVL_NEEDS_AMX | CVL_AMX_INT8)
#define CVL_NEEDS_AMX_BF16 (CVL_NEEDS_AVX512_BF16 | CVL_NEEDS_AMX | CVL_AMX_BF16)

#endif
