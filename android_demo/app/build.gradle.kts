import java.util.Properties
import org.jetbrains.kotlin.gradle.dsl.JvmTarget

plugins {
    id("com.android.application")
    id("org.jetbrains.kotlin.android")
}

// Settings (README.md, "Build it"): local.properties first, then -P... or gradle.properties.
// None is needed to sync: missing ones are found (a python3 on PATH with this repository's
// requirements installed) or defaulted, and only the native build stops, saying what to set.
val localProperties = Properties().apply {
    val file = rootProject.file("local.properties")
    if (file.isFile) file.inputStream().use { load(it) }
}

fun setting(name: String): String =
    localProperties.getProperty(name) ?: (findProperty(name) as String?) ?: ""

// The pip packages' directories (executorch's headers, nlohmann_json's), from the python3 on
// PATH; empty where it or they are missing.
val pythonProbe: List<String> by lazy {
    val script = "import importlib.util as u\n" +
        "for name in ('executorch', 'nlohmann_json'):\n" +
        "    spec = u.find_spec(name)\n" +
        "    print(spec.submodule_search_locations[0] if spec else '')"
    runCatching {
        providers.exec {
            commandLine("python3", "-c", script)
            isIgnoreExitValue = true
        }.standardOutput.asText.get().lines()
    }.getOrDefault(emptyList())
}

// The ExecuTorch release the bundles are exported with (pyproject.toml's executorch pin).
val executorchVersion = setting("executorchAarVersion").ifBlank { "1.5.1" }
val executorchWheel = setting("executorchWheelDir").ifBlank { pythonProbe.getOrElse(0) { "" } }
val nlohmannDir = setting("nlohmannJsonAndroidDir")
val nlohmannInclude =
    pythonProbe.getOrElse(1) { "" }.let { if (it.isBlank()) it else "$it/include" }

// Where ExecuTorch's native runtime comes from. By default the ExecuTorch AAR from Maven
// Central: the APK packages its libexecutorch.so (runtime, XNNPACK, kernels, llama ops) and the
// core links it, with the pip wheel's headers. With executorchAndroidPrefix set, an ExecuTorch
// cross-compiled from source (README.md, route B) is linked statically instead.
val executorchPrefix = setting("executorchAndroidPrefix")
val useAar = executorchPrefix.isBlank()
val executorchAar: Configuration by configurations.creating
val aarJniDir = layout.buildDirectory.dir("executorch-aar")

val executorchArguments: List<String> = if (useAar) {
    listOf(
        "-DMTP_EXECUTORCH_LIBS=${aarJniDir.get().asFile}/jni/arm64-v8a/libexecutorch.so",
        "-DEXECUTORCH_INCLUDE_DIRS=$executorchWheel/include;" +
            "$executorchWheel/include/executorch/runtime/core/portable_type/c10",
    )
} else {
    listOf(
        "-DEXECUTORCH_ROOT=$executorchPrefix",
        "-Dexecutorch_DIR=$executorchPrefix/lib/cmake/ExecuTorch",
    )
}

// nlohmann/json (headers only): a CMake package installed for the cross build, else the pip
// package's headers (never the host's /usr/include: host glibc headers would leak in).
val nlohmannArguments: List<String> =
    if (nlohmannDir.isNotBlank()) listOf("-Dnlohmann_json_DIR=$nlohmannDir")
    else listOf("-DMTP_NLOHMANN_INCLUDE=$nlohmannInclude")

// What the native build lacks, each with what to do; checked before CMake runs.
fun missingNativeSettings(): List<String> = buildList {
    if (useAar && !file("$executorchWheel/include/executorch").isDirectory) {
        add(
            "ExecuTorch's headers: pip install executorch==$executorchVersion for the python3 " +
                "on PATH, or set executorchWheelDir (site-packages/executorch)",
        )
    }
    if (!useAar && !file("$executorchPrefix/lib/cmake/ExecuTorch").isDirectory) {
        add("ExecuTorch built from source under executorchAndroidPrefix=$executorchPrefix")
    }
    if (nlohmannDir.isBlank() && !file("$nlohmannInclude/nlohmann/json.hpp").isFile) {
        add(
            "nlohmann/json: pip install nlohmann_json for the python3 on PATH, or set " +
                "nlohmannJsonAndroidDir (its CMake package directory)",
        )
    }
}

android {
    namespace = "org.mtpedge.demo"
    compileSdk = 35
    ndkVersion = "27.2.12479018"

    defaultConfig {
        applicationId = "org.mtpedge.demo"
        minSdk = 28
        targetSdk = 35
        versionCode = 1
        versionName = "0.1"
        ndk {
            abiFilters += "arm64-v8a"
        }
        externalNativeBuild {
            cmake {
                arguments += listOf(
                    "-DANDROID_STL=c++_shared",
                    "-DANDROID_PLATFORM=android-28",
                ) + nlohmannArguments + executorchArguments
            }
        }
    }

    externalNativeBuild {
        cmake {
            path = file("src/main/cpp/CMakeLists.txt")
            version = "3.22.1"
        }
    }

    buildTypes {
        release {
            isMinifyEnabled = false
            signingConfig = signingConfigs.getByName("debug")
        }
    }

    compileOptions {
        sourceCompatibility = JavaVersion.VERSION_17
        targetCompatibility = JavaVersion.VERSION_17
    }
    packaging {
        jniLibs {
            // Native libraries stay uncompressed in the APK and are loaded from it directly.
            useLegacyPackaging = false
            // Our build and the ExecuTorch AAR both bring the NDK's C++ runtime.
            pickFirsts += "**/libc++_shared.so"
        }
    }
}

kotlin {
    compilerOptions {
        jvmTarget.set(JvmTarget.JVM_17)
    }
}

// No AndroidX and no ExecuTorch Java API: the UI is framework widgets and every call goes
// through our JNI library to the C++ core.
dependencies {
    if (useAar) {
        val aar = "org.pytorch:executorch-android:$executorchVersion"
        implementation(aar)  // packages libexecutorch.so (and fbjni) into the APK
        executorchAar("$aar@aar") { isTransitive = false }
    }
}

// Before CMake runs: one message naming everything the native build lacks (README.md, "Build
// it"), instead of a CMake error deep in the log.
val checkNativeSettings by tasks.registering {
    doLast {
        val missing = missingNativeSettings()
        if (missing.isNotEmpty()) {
            throw GradleException(
                "the native build needs " + missing.joinToString("; and ") +
                    " (in android_demo/local.properties; see android_demo/README.md)",
            )
        }
    }
}

// The core links libexecutorch.so at build time: take it out of the AAR before CMake runs.
val extractExecutorch by tasks.registering(Copy::class) {
    from({ zipTree(executorchAar.singleFile) }) { include("jni/arm64-v8a/libexecutorch.so") }
    into(aarJniDir)
}
tasks.configureEach {
    if (name.startsWith("configureCMake") || name.startsWith("buildCMake")) {
        dependsOn(checkNativeSettings)
        if (useAar) dependsOn(extractExecutorch)
    }
}
