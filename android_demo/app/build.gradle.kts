import java.util.Properties
import org.jetbrains.kotlin.gradle.dsl.JvmTarget

plugins {
    id("com.android.application")
    id("org.jetbrains.kotlin.android")
}

// Settings (README.md, "Build and install the app"): local.properties first, then -P... or
// gradle.properties.
val localProperties = Properties().apply {
    val file = rootProject.file("local.properties")
    if (file.isFile) file.inputStream().use { load(it) }
}

fun setting(name: String): String =
    localProperties.getProperty(name) ?: (findProperty(name) as String?) ?: ""

fun required(name: String): String = setting(name).ifBlank {
    throw GradleException("set $name in android_demo/local.properties (see android_demo/README.md)")
}

// Where ExecuTorch's native runtime comes from. By default the ExecuTorch AAR from Maven
// Central: the APK packages its libexecutorch.so (runtime, XNNPACK, kernels, llama ops) and the
// core links it, with the pip wheel's headers. With executorchAndroidPrefix set, an ExecuTorch
// cross-compiled from source (README.md, route B) is linked statically instead.
val executorchPrefix = setting("executorchAndroidPrefix")
val useAar = executorchPrefix.isBlank()
val executorchAar: Configuration by configurations.creating
val aarJniDir = layout.buildDirectory.dir("executorch-aar")

val executorchArguments: List<String> = if (useAar) {
    val wheel = required("executorchWheelDir")
    listOf(
        "-DMTP_EXECUTORCH_LIBS=${aarJniDir.get().asFile}/jni/arm64-v8a/libexecutorch.so",
        "-DEXECUTORCH_INCLUDE_DIRS=$wheel/include;" +
            "$wheel/include/executorch/runtime/core/portable_type/c10",
    )
} else {
    listOf(
        "-DEXECUTORCH_ROOT=$executorchPrefix",
        "-Dexecutorch_DIR=$executorchPrefix/lib/cmake/ExecuTorch",
    )
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
                    "-Dnlohmann_json_DIR=${required("nlohmannJsonAndroidDir")}",
                ) + executorchArguments
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
        val aar = "org.pytorch:executorch-android:${required("executorchAarVersion")}"
        implementation(aar)  // packages libexecutorch.so (and fbjni) into the APK
        executorchAar("$aar@aar") { isTransitive = false }
    }
}

// The core links libexecutorch.so at build time: take it out of the AAR before CMake runs.
val extractExecutorch by tasks.registering(Copy::class) {
    from({ zipTree(executorchAar.singleFile) }) { include("jni/arm64-v8a/libexecutorch.so") }
    into(aarJniDir)
}
tasks.configureEach {
    if (useAar && (name.startsWith("configureCMake") || name.startsWith("buildCMake"))) {
        dependsOn(extractExecutorch)
    }
}
