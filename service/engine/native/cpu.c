/* The CPU feature probe (cpu.h): CPUID leaves 1 and 7, XGETBV for the state the OS saves, the Linux AMX permission.
 *
 * Why our own and not __builtin_cpu_supports: one probe that C and Python read (native.py asks cvl_cpu_features
 * through ctypes), that also holds what only a syscall tells (whether Linux lets this process use the AMX tile data),
 * and that tests can restrict (cvl_isa_features) instead of each kernel asking the CPU on its own. The result is a
 * table written once, when the library loads (pthread_once), and only read afterwards. */

#include "cpu.h"

#include <cpuid.h>
#include <pthread.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define XCR0_AVX 0x6u              /* SSE and AVX (YMM) state */
#define XCR0_AVX512 0xe0u          /* opmask, ZMM_Hi256, Hi16_ZMM */
#define XCR0_AMX (3u << 17)        /* XTILECFG, XTILEDATA */

static const char* const NAMES[CVL_FEATURE_COUNT] = {
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
    "amx_bf16",
};

static pthread_once_t probed = PTHREAD_ONCE_INIT;
static cvl_features host; /* written once by probe() */

static uint64_t xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static cvl_features bit_if(uint32_t reg, int bit, cvl_features feature) { return (reg >> bit) & 1u ? feature : 0; }

/* Features of CPUID leaf 7 (subleaves 0 and 1) whose register state the OS saves. */
static cvl_features leaf7_features(uint64_t xcr) {
    uint32_t a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const uint32_t subleaves = a;
    cvl_features f = (xcr & XCR0_AVX) == XCR0_AVX ? bit_if(b, 5, CVL_AVX2) : 0;
    if ((xcr & (XCR0_AVX | XCR0_AVX512)) == (XCR0_AVX | XCR0_AVX512)) {
        f |= bit_if(b, 16, CVL_AVX512F) | bit_if(b, 30, CVL_AVX512BW) | bit_if(b, 31, CVL_AVX512VL);
        f |= bit_if(c, 11, CVL_AVX512_VNNI);
        uint32_t a1 = 0, b1, c1, d1;
        if (subleaves >= 1 && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) f |= bit_if(a1, 5, CVL_AVX512_BF16);
    }
    if ((xcr & XCR0_AMX) == XCR0_AMX && (d >> 24) & 1u) { /* AMX-TILE: the OS must still grant this process */
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0)
            f |= CVL_AMX_TILE | bit_if(d, 25, CVL_AMX_INT8) | bit_if(d, 22, CVL_AMX_BF16);
    }
    return f;
}

static void probe(void) {
    uint32_t a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return; /* no OSXSAVE: no AVX state, nothing here */
    const uint64_t xcr = xcr0();
    cvl_features f = 0;
    if ((xcr & XCR0_AVX) == XCR0_AVX && (c >> 28) & 1u) f |= bit_if(c, 12, CVL_FMA) | bit_if(c, 29, CVL_F16C);
    host = f | leaf7_features(xcr);
}

cvl_features cvl_cpu_features(void) {
    pthread_once(&probed, probe);
    return host;
}

__attribute__((constructor)) static void probe_at_load(void) { (void)cvl_cpu_features(); }

const char* cvl_feature_name(int bit) { return bit >= 0 && bit < CVL_FEATURE_COUNT ? NAMES[bit] : NULL; }

cvl_features cvl_isa_features(cvl_isa ceiling) {
    const cvl_features all = cvl_cpu_features();
    switch (ceiling) {
        case CVL_ISA_AUTO: return all;
        case CVL_ISA_NO_AMX: return all & ~(cvl_features)CVL_AMX_ANY;
        default: return 0;
    }
}

int cvl_isa_parse(const char* name) {
    if (name == NULL) return -1;
    if (strcmp(name, "auto") == 0) return CVL_ISA_AUTO;
    if (strcmp(name, "no-amx") == 0) return CVL_ISA_NO_AMX;
    if (strcmp(name, "portable") == 0) return CVL_ISA_PORTABLE;
    return -1;
}
