/*
 * A fake libnvidia-ml.so.1 for tests: exports the NVML symbols preemptd's GPU monitor calls, with the
 * structure layouts of NVIDIA's nvml.h (as pynvml's ctypes definitions expect them), and answers from a
 * scenario file so that the real pynvml runs unchanged through ctypes.
 *
 * The scenario is a key=value text file named by $FAKE_NVML_SCENARIO; it is re-read whenever it changes
 * (write a new file and rename it over the old one), so a test can change conditions mid-run.
 * Keys are documented in tests/fake_nvml/README.md. Per-GPU keys are "gpu.<index>.<key>"; a key without
 * the prefix is the default for every GPU.
 *
 * Build: gcc -shared -fPIC -pthread -Wl,-soname,libnvidia-ml.so.1 -Wl,--no-undefined
 *            -o libnvidia-ml.so.1 fake_nvml.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- the parts of nvml.h that matter; layouts must match pynvml's ctypes Structures ---- */

typedef int nvmlReturn_t; /* a C enum: int-sized */

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 16
#define MAX_PROCS 64

struct nvmlDevice_st {
    unsigned index;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

/* nvmlProcessInfo_v2_t == v3, what nvmlDeviceGetComputeRunningProcesses_v3 fills */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    signed int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

#define NVML_VALUE_TYPE_UNSIGNED_INT 1

struct nvmlEventSet_st {
    unsigned long long mask[MAX_GPUS];
};
typedef struct nvmlEventSet_st *nvmlEventSet_t;

_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t layout");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t layout");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t layout");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t layout");

/* ---- scenario store ---- */

#define MAX_ENTRIES 1024
#define MAX_EVENTS 512

struct entry {
    char key[128];
    char value[256];
};

struct pending_event {
    char id[64];
    long long first_seen_ms;
    int delivered;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct entry g_entries[MAX_ENTRIES];
static int g_count;
static struct stat g_seen;
static int g_loaded;
static struct pending_event g_events[MAX_EVENTS];
static int g_nevents;
static int g_init_count;
static struct nvmlDevice_st g_devices[MAX_GPUS];

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t') s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\n' || s[n - 1] == '\r')) s[--n] = 0;
    return s;
}

/* Copy the value of key into out; returns 1 if present. Caller holds g_lock. */
static int lookup_locked(const char *key, char *out, size_t size) {
    for (int i = g_count - 1; i >= 0; i--) {
        if (strcmp(g_entries[i].key, key) == 0) {
            snprintf(out, size, "%s", g_entries[i].value);
            return 1;
        }
    }
    return 0;
}

static char g_session[128];

/* Remember when each event id was first seen; a new "session" value (one per test) forgets them all. */
static void note_events_locked(void) {
    char session[128] = "";
    lookup_locked("session", session, sizeof session);
    if (strcmp(session, g_session) != 0) {
        snprintf(g_session, sizeof g_session, "%s", session);
        g_nevents = 0;
    }
    for (int i = 0; i < g_count; i++) {
        if (strncmp(g_entries[i].key, "event.", 6) != 0) continue;
        const char *id = g_entries[i].key + 6;
        int known = 0;
        for (int j = 0; j < g_nevents; j++) {
            if (strcmp(g_events[j].id, id) == 0) {
                known = 1;
                break;
            }
        }
        if (!known && g_nevents < MAX_EVENTS) {
            snprintf(g_events[g_nevents].id, sizeof g_events[g_nevents].id, "%s", id);
            g_events[g_nevents].first_seen_ms = now_ms();
            g_events[g_nevents].delivered = 0;
            g_nevents++;
        }
    }
}

/* Re-read the scenario file if it changed (inode, size or mtime). Caller holds g_lock. */
static void refresh_locked(void) {
    const char *path = getenv("FAKE_NVML_SCENARIO");
    struct stat st;
    if (path == NULL || stat(path, &st) != 0) {
        if (g_loaded) {
            g_count = 0;
            g_loaded = 0;
        }
        return;
    }
    if (g_loaded && st.st_ino == g_seen.st_ino && st.st_size == g_seen.st_size &&
        st.st_mtim.tv_sec == g_seen.st_mtim.tv_sec && st.st_mtim.tv_nsec == g_seen.st_mtim.tv_nsec)
        return;
    FILE *f = fopen(path, "r");
    if (f == NULL) return;
    g_count = 0;
    char line[512];
    while (fgets(line, sizeof line, f) != NULL && g_count < MAX_ENTRIES) {
        char *s = trim(line);
        if (*s == 0 || *s == '#') continue;
        char *eq = strchr(s, '=');
        if (eq == NULL) continue;
        *eq = 0;
        snprintf(g_entries[g_count].key, sizeof g_entries[g_count].key, "%s", trim(s));
        snprintf(g_entries[g_count].value, sizeof g_entries[g_count].value, "%s", trim(eq + 1));
        g_count++;
    }
    fclose(f);
    g_seen = st;
    g_loaded = 1;
    note_events_locked();
}

/* The value for GPU `gpu` (or the global default); returns 1 if present. */
static int get_str(int gpu, const char *name, char *out, size_t size) {
    char key[160];
    int found = 0;
    pthread_mutex_lock(&g_lock);
    refresh_locked();
    if (gpu >= 0) {
        snprintf(key, sizeof key, "gpu.%d.%s", gpu, name);
        found = lookup_locked(key, out, size);
    }
    if (!found) found = lookup_locked(name, out, size);
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* The value for GPU `gpu` only (identity keys have no global default). */
static int get_own(int gpu, const char *name, char *out, size_t size) {
    char key[160];
    snprintf(key, sizeof key, "gpu.%d.%s", gpu, name);
    pthread_mutex_lock(&g_lock);
    refresh_locked();
    int found = lookup_locked(key, out, size);
    pthread_mutex_unlock(&g_lock);
    return found;
}

static unsigned long long get_num(int gpu, const char *name, unsigned long long fallback) {
    char value[256];
    if (!get_str(gpu, name, value, sizeof value) || value[0] == 0) return fallback;
    return strtoull(value, NULL, 0);
}

static int truthy(const char *v) {
    return v[0] != 0 && strcmp(v, "0") != 0 && strcmp(v, "false") != 0 && strcmp(v, "no") != 0;
}

/*
 * The common prologue of every call: hang while "hang.<fn>" is set, then the injected result for this
 * call, if any: "error.<fn>=<code>" (or "not_supported=<fn>,<fn>"), then "lost=1" (every call on the GPU
 * returns GPU_IS_LOST). Returns NVML_SUCCESS when the call should go on normally.
 */
static nvmlReturn_t prologue(int gpu, const char *fn) {
    char key[160], value[256];
    snprintf(key, sizeof key, "hang.%s", fn);
    while (get_str(gpu, key, value, sizeof value) && truthy(value)) sleep_ms(10);
    snprintf(key, sizeof key, "error.%s", fn);
    if (get_str(gpu, key, value, sizeof value) && value[0]) return (nvmlReturn_t)strtol(value, NULL, 0);
    if (get_str(gpu, "not_supported", value, sizeof value)) {
        char *save = NULL;
        for (char *tok = strtok_r(value, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save))
            if (strcmp(tok, fn) == 0) return NVML_ERROR_NOT_SUPPORTED;
    }
    if (gpu >= 0 && get_str(gpu, "lost", value, sizeof value) && truthy(value)) return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

static unsigned device_count(void) {
    unsigned n = (unsigned)get_num(-1, "device_count", 1);
    return n > MAX_GPUS ? MAX_GPUS : n;
}

static int device_index(nvmlDevice_t device) {
    if (device == NULL || device < &g_devices[0] || device >= &g_devices[MAX_GPUS]) return -1;
    return (int)(device - &g_devices[0]);
}

#define DEVICE_PROLOGUE(fn)                                    \
    int gpu = device_index(device);                            \
    if (gpu < 0) return NVML_ERROR_INVALID_ARGUMENT;           \
    if (g_init_count <= 0) return NVML_ERROR_UNINITIALIZED;    \
    nvmlReturn_t rc_ = prologue(gpu, fn);                      \
    if (rc_ != NVML_SUCCESS) return rc_;

/* ---- library ---- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    nvmlReturn_t rc = prologue(-1, "nvmlInitWithFlags");
    if (rc != NVML_SUCCESS) return rc;
    pthread_mutex_lock(&g_lock);
    g_init_count++;
    for (unsigned i = 0; i < MAX_GPUS; i++) g_devices[i].index = i;
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    nvmlReturn_t rc = prologue(-1, "nvmlShutdown");
    if (rc != NVML_SUCCESS) return rc;
    pthread_mutex_lock(&g_lock);
    if (g_init_count <= 0) {
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    g_init_count--;
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t copy_text(const char *text, char *out, unsigned int length) {
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, text, strlen(text) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (g_init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t rc = prologue(-1, "nvmlSystemGetDriverVersion");
    if (rc != NVML_SUCCESS) return rc;
    char value[256] = "999.99.99-fake";
    get_str(-1, "driver_version", value, sizeof value);
    return copy_text(value, version, length);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    return copy_text("13.999.99-fake", version, length);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (g_init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t rc = prologue(-1, "nvmlDeviceGetCount_v2");
    if (rc != NVML_SUCCESS) return rc;
    *count = device_count();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (g_init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    if (index >= device_count()) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = prologue((int)index, "nvmlDeviceGetHandleByIndex_v2");
    if (rc != NVML_SUCCESS) return rc;
    *device = &g_devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    DEVICE_PROLOGUE("nvmlDeviceGetIndex");
    *index = (unsigned)gpu;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEVICE_PROLOGUE("nvmlDeviceGetUUID");
    char value[256];
    if (!get_own(gpu, "uuid", value, sizeof value))
        snprintf(value, sizeof value, "GPU-fa4e0000-0000-4000-8000-%012d", gpu);
    return copy_text(value, uuid, length);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEVICE_PROLOGUE("nvmlDeviceGetName");
    char value[256] = "NVIDIA H200 (fake)";
    if (!get_own(gpu, "name", value, sizeof value)) get_str(-1, "name", value, sizeof value);
    return copy_text(value, name, length);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEVICE_PROLOGUE("nvmlDeviceGetPciInfo_v3");
    char value[256];
    unsigned domain = 0, bus = 0x18 + (unsigned)gpu, dev = 0, fn = 0;
    if (get_own(gpu, "pci", value, sizeof value)) sscanf(value, "%x:%x:%x.%x", &domain, &bus, &dev, &fn);
    memset(pci, 0, sizeof *pci);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = 0x233510de;
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", domain, bus, dev, fn);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain & 0xffff, bus, dev, fn);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp) {
    DEVICE_PROLOGUE("nvmlDeviceGetTemperature");
    if (sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = (unsigned)get_num(gpu, "temp", 40);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device, int threshold, unsigned int *temp) {
    DEVICE_PROLOGUE("nvmlDeviceGetTemperatureThreshold");
    switch (threshold) {
    case 0: *temp = (unsigned)get_num(gpu, "temp_shutdown", 92); break;
    case 1: *temp = (unsigned)get_num(gpu, "temp_slowdown", 87); break;
    case 2: *temp = (unsigned)get_num(gpu, "temp_mem_max", 95); break;
    case 3: *temp = (unsigned)get_num(gpu, "temp_gpu_max", 85); break;
    default: return NVML_ERROR_NOT_SUPPORTED;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    DEVICE_PROLOGUE("nvmlDeviceGetPowerUsage");
    *power = (unsigned)get_num(gpu, "power_mw", 300000);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    DEVICE_PROLOGUE("nvmlDeviceGetEnforcedPowerLimit");
    *limit = (unsigned)get_num(gpu, "power_limit_mw", 700000);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType,
                                         unsigned long long *count) {
    DEVICE_PROLOGUE("nvmlDeviceGetTotalEccErrors");
    if (errorType == 1 && counterType == 0) *count = get_num(gpu, "ecc_uncorrected_volatile", 0);
    else if (errorType == 0 && counterType == 0) *count = get_num(gpu, "ecc_corrected_volatile", 0);
    else *count = get_num(gpu, "ecc_aggregate", 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *pending) {
    DEVICE_PROLOGUE("nvmlDeviceGetRetiredPagesPendingStatus");
    *pending = get_num(gpu, "retired_pages_pending", 0) ? 1 : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred) {
    DEVICE_PROLOGUE("nvmlDeviceGetRemappedRows");
    *corrRows = (unsigned)get_num(gpu, "remapped_rows_correctable", 0);
    *uncRows = (unsigned)get_num(gpu, "remapped_rows_uncorrectable", 0);
    *isPending = get_num(gpu, "remap_pending", 0) ? 1 : 0;
    *failureOccurred = get_num(gpu, "remap_failure", 0) ? 1 : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons) {
    DEVICE_PROLOGUE("nvmlDeviceGetCurrentClocksEventReasons");
    *reasons = get_num(gpu, "clocks_event_reasons", 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons) {
    DEVICE_PROLOGUE("nvmlDeviceGetCurrentClocksThrottleReasons");
    *reasons = get_num(gpu, "clocks_event_reasons", 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    DEVICE_PROLOGUE("nvmlDeviceGetComputeRunningProcesses_v3");
    char value[256] = "";
    unsigned pids[MAX_PROCS];
    unsigned n = 0;
    get_str(gpu, "pids", value, sizeof value);
    char *save = NULL;
    for (char *tok = strtok_r(value, ", ", &save); tok && n < MAX_PROCS; tok = strtok_r(NULL, ", ", &save))
        pids[n++] = (unsigned)strtoul(tok, NULL, 0);
    if (infoCount == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (*infoCount < n || (infos == NULL && n > 0)) {
        *infoCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < n; i++) {
        infos[i].pid = pids[i];
        infos[i].usedGpuMemory = 1ULL << 30;
        infos[i].gpuInstanceId = 0xFFFFFFFFu;
        infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    *infoCount = n;
    return NVML_SUCCESS;
}

#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values) {
    DEVICE_PROLOGUE("nvmlDeviceGetFieldValues");
    char text[256];
    for (int i = 0; i < valuesCount; i++) {
        values[i].timestamp = 0;
        values[i].latencyUsec = 0;
        values[i].value.ullVal = 0;
        if (!get_str(gpu, "recovery_action", text, sizeof text) || text[0] == 0) snprintf(text, sizeof text, "0");
        if (values[i].fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION && strcmp(text, "unsupported") != 0) {
            values[i].valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            values[i].nvmlReturn = NVML_SUCCESS;
            values[i].value.uiVal = (unsigned)strtoul(text, NULL, 0);
        } else {
            values[i].nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}

/* ---- events ---- */

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (g_init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t rc = prologue(-1, "nvmlEventSetCreate");
    if (rc != NVML_SUCCESS) return rc;
    *set = calloc(1, sizeof(struct nvmlEventSet_st));
    return *set ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    free(set);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    DEVICE_PROLOGUE("nvmlDeviceGetSupportedEventTypes");
    *eventTypes = get_num(gpu, "supported_events", 0x1 | 0x2 | 0x8 | 0x4000 | 0x8000);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) {
    DEVICE_PROLOGUE("nvmlDeviceRegisterEvents");
    unsigned long long supported = get_num(gpu, "supported_events", 0x1 | 0x2 | 0x8 | 0x4000 | 0x8000);
    if (set == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (eventTypes & ~supported) return NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&g_lock);
    set->mask[gpu] |= eventTypes;
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

static unsigned long long event_type(const char *name) {
    if (strcmp(name, "xid") == 0) return 0x8;
    if (strcmp(name, "dbe") == 0) return 0x2;
    if (strcmp(name, "sbe") == 0) return 0x1;
    if (strcmp(name, "unavailable") == 0) return 0x4000;
    if (strcmp(name, "recovery") == 0) return 0x8000;
    return strtoull(name, NULL, 0);
}

/* Deliver the first due event ("event.<id>=<gpu>,<type>,<data>[,<delay_ms>]") registered in `set`. */
static int take_event(nvmlEventSet_t set, nvmlEventData_t *data) {
    int found = 0;
    pthread_mutex_lock(&g_lock);
    refresh_locked();
    long long now = now_ms();
    for (int i = 0; i < g_nevents && !found; i++) {
        struct pending_event *ev = &g_events[i];
        if (ev->delivered) continue;
        char key[200], value[256];
        snprintf(key, sizeof key, "event.%.64s", ev->id);
        if (!lookup_locked(key, value, sizeof value)) continue;
        char type[64] = "";
        int gpu = -1;
        unsigned long long payload = 0;
        long delay = 0;
        if (sscanf(value, "%d , %63[^,] , %lli , %li", &gpu, type, &payload, &delay) < 3) continue;
        if (gpu < 0 || gpu >= MAX_GPUS || now < ev->first_seen_ms + delay) continue;
        unsigned long long kind = event_type(trim(type));
        if ((set->mask[gpu] & kind) == 0) continue;
        ev->delivered = 1;
        memset(data, 0, sizeof *data);
        data->device = &g_devices[gpu];
        data->eventType = kind;
        data->eventData = payload;
        data->gpuInstanceId = 0xFFFFFFFFu;
        data->computeInstanceId = 0xFFFFFFFFu;
        found = 1;
    }
    pthread_mutex_unlock(&g_lock);
    return found;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (g_init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t rc = prologue(-1, "nvmlEventSetWait_v2");
    if (rc != NVML_SUCCESS) return rc;
    if (set == NULL || data == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    long long deadline = now_ms() + timeoutms;
    for (;;) {
        if (take_event(set, data)) return NVML_SUCCESS;
        if (now_ms() >= deadline) return NVML_ERROR_TIMEOUT;
        sleep_ms(5);
    }
}
