// A CUDA injection library (CUDA_INJECTION64_PATH) that records every kernel's start and end
// through CUPTI's activity API, kernel nodes of replayed CUDA graphs included, and writes them as
// CSV (name,start_ns,end_ns,graph_node; copies and memsets as "[memcpy ...]" rows) to $KERNEL_TRACE_OUT when the process exits.
#include <cupti.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {
struct Rec { std::string name; unsigned long long start, end, node; };
std::vector<Rec>* records;
std::mutex lock;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *size = 8 << 20;
    *buffer = static_cast<uint8_t*>(aligned_alloc(8, *size));
    *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
    CUpti_Activity* rec = nullptr;
    std::lock_guard<std::mutex> g(lock);
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(rec);
            records->push_back({k->name ? k->name : "?", k->start, k->end, k->graphNodeId});
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(rec);
            records->push_back({"[memcpy " + std::to_string(m->bytes) + " B kind " + std::to_string(m->copyKind) + "]",
                                m->start, m->end, m->graphNodeId});
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(rec);
            records->push_back({"[memset " + std::to_string(m->bytes) + " B]", m->start, m->end, m->graphNodeId});
        }
    }
    free(buffer);
}

void write_out() {
    cuptiActivityFlushAll(1);
    const char* path = getenv("KERNEL_TRACE_OUT");
    FILE* f = fopen(path ? path : "kernel_trace.csv", "w");
    if (!f) return;
    fprintf(f, "name,start_ns,end_ns,graph_node\n");
    std::lock_guard<std::mutex> g(lock);
    for (auto& r : *records) {
        std::string n = r.name.substr(0, r.name.find('('));
        for (auto& c : n) if (c == ',') c = ';';
        fprintf(f, "%s,%llu,%llu,%llu\n", n.c_str(), r.start, r.end, r.node);
    }
    fclose(f);
}
}  // namespace

extern "C" int InitializeInjection() {
    records = new std::vector<Rec>();
    records->reserve(1 << 20);
    cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fprintf(stderr, "kernel_trace: cuptiActivityEnable failed\n");
        return 0;
    }
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
    atexit(write_out);
    return 1;
}
