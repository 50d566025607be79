/* ONNX Runtime's entry point to the library: RegisterCustomOps adds every registered operator (op.h: the kit's and
 * the layers', each registered in its own file) to the domain cosyvoice_lite.
 *
 * Loaded with SessionOptions.register_custom_ops_library(path) (service/engine/native.py). The runtime is checked
 * first (ort_api.h: its version and C API against the entries the operators call): an older one gets an error
 * status, so its session fails to open and the engine runs ONNX Runtime's own graphs instead. */

#include <stdio.h>

#include "op.h"
#include "ort_api.h"

#define DOMAIN "cosyvoice_lite"

OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base);

OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
    cvl_ort ort;
    char why[256];
    if (cvl_ort_bind(base, &ort, why, sizeof why) != 0)
        return ort.CreateStatus != NULL ? ort.CreateStatus(CVL_ORT_FAIL, why) : NULL;
    OrtCustomOpDomain* domain;
    OrtStatus* s = ort.CreateCustomOpDomain(DOMAIN, &domain);
    for (int i = 0; !s && i < cvl_op_count(); i++) s = ort.CustomOpDomain_Add(domain, cvl_op_at(i)->ort);
    if (!s) s = ort.AddCustomOpDomain(options, domain);
    return s;
}
