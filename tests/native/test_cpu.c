/* The CPU probe (cpu.h) and the operator registry (op.h): every feature the probe reports is a flag Linux lists for
 * this CPU and every listed flag we choose by is reported (the AMX ones only where Linux grants the tile data); the
 * ceilings restrict, never add; every registered operator has a portable variant 0 that it picks with no features. */

#include <stdio.h>

#include "check.h"

/* Whether /proc/cpuinfo's first "flags" line lists `flag`; -1 when there is no such file. */
static int cpuinfo_lists(const char* flag) {
    FILE* f = fopen("/proc/cpuinfo", "r");
    if (f == NULL) return -1;
    static char line[16384];
    int found = 0;
    while (fgets(line, sizeof line, f) != NULL) {
        if (strncmp(line, "flags", 5) != 0) continue;
        for (char* tok = strtok(strchr(line, ':') + 1, " \t\n"); tok != NULL; tok = strtok(NULL, " \t\n"))
            found |= strcmp(tok, flag) == 0;
        break;
    }
    fclose(f);
    return found;
}

static void check_probe(void) {
    const cvl_features host = cvl_cpu_features();
    CHECK(host == cvl_cpu_features(), "the probe answers the same every time");
    for (int bit = 0; bit < CVL_FEATURE_COUNT; bit++) {
        const char* name = cvl_feature_name(bit);
        CHECK(name != NULL, "feature %d has a name", bit);
        const int listed = cpuinfo_lists(name), probed = (host >> bit) & 1;
        if (listed < 0) continue;
        if (probed) CHECK(listed, "the probe reports %s, /proc/cpuinfo does not list it", name);
        if (listed && !((1u << bit) & CVL_AMX_ANY)) CHECK(probed, "/proc/cpuinfo lists %s, the probe misses it", name);
    }
    CHECK(cvl_feature_name(CVL_FEATURE_COUNT) == NULL && cvl_feature_name(-1) == NULL, "no name past the table");
    CHECK(!(host & CVL_AVX512BW) || (host & CVL_AVX512F), "AVX-512BW without AVX-512F");
    CHECK(!(host & CVL_AMX_INT8) || (host & CVL_AMX_TILE), "AMX-INT8 without tiles");
    printf("probe: 0x%x", (unsigned)host);
    for (int bit = 0; bit < CVL_FEATURE_COUNT; bit++)
        if ((host >> bit) & 1) printf(" %s", cvl_feature_name(bit));
    printf("\n");
}

static void check_ceilings(void) {
    const cvl_features host = cvl_cpu_features();
    CHECK(cvl_isa_features(CVL_ISA_AUTO) == host, "auto: every feature");
    CHECK(cvl_isa_features(CVL_ISA_NO_AMX) == (host & ~(cvl_features)CVL_AMX_ANY), "no-amx: all but the tiles");
    CHECK(cvl_isa_features(CVL_ISA_PORTABLE) == 0, "portable: none");
    CHECK(cvl_isa_parse("auto") == CVL_ISA_AUTO && cvl_isa_parse("no-amx") == CVL_ISA_NO_AMX &&
              cvl_isa_parse("portable") == CVL_ISA_PORTABLE,
          "ceiling names");
    CHECK(cvl_isa_parse("AVX512") < 0 && cvl_isa_parse("") < 0 && cvl_isa_parse(NULL) < 0, "unknown ceilings refused");
}

static void check_registry(cvl_features allowed) {
    static const char* const KIT[] = {"CachedAttention", "Int8MatMul", "BF16Conv1d"};
    static const char* const LAYERS[] = {"EstimatorBlock", "Qwen2Layer", "RelPosLayer", "DiTBlock", "NormMish"};
    CHECK(cvl_op_count() == 8, "%d operators registered", cvl_op_count());
    for (int i = 0; i < 3; i++) CHECK(cvl_op_named(KIT[i]) != NULL, "%s registered", KIT[i]);
    for (int i = 0; i < 5; i++) CHECK(cvl_op_named(LAYERS[i]) != NULL, "%s registered", LAYERS[i]);
    CHECK(cvl_op_named("Nothing") == NULL && cvl_op_variant("Nothing", 0, 0) == NULL, "unknown operator");
    for (int i = 0; i < cvl_op_count(); i++) {
        const cvl_op* op = cvl_op_at(i);
        const cvl_variants* v = op->variants;
        CHECK(op->ort != NULL && v->count >= 1 && v->variants[0].needs == 0, "%s: a portable variant 0", op->name);
        CHECK(strcmp(cvl_op_variant(op->name, 0, 64), "portable") == 0, "%s: no features, portable", op->name);
        const char* chosen = cvl_op_variant(op->name, allowed, 64);
        const int at = cvl_pick_variant(v, allowed, 64);
        CHECK(cvl_has(allowed, v->variants[at].needs) && strcmp(chosen, v->variants[at].name) == 0,
              "%s: picks what the features hold", op->name);
        printf("%s: %s\n", op->name, chosen);
    }
    CHECK(cvl_op_at(cvl_op_count()) == NULL, "no operator past the registry");
}

int main(int argc, char** argv) {
    const cvl_features allowed = run_features(argc, argv);
    check_probe();
    check_ceilings();
    check_registry(allowed);
    report("test_cpu", allowed);
    return 0;
}
