import java.util.Properties
import org.jetbrains.kotlin.gradle.dsl.JvmTarget

plugins {
    id("com.android.application")
    id("org.jetbrains.kotlin.android")
}

// Paths of the cross-compiled ExecuTorch and of nlohmann/json: local.properties first, then
// -P... / gradle.properties.
val localProperties = Properties().apply {
    val file = rootProject.file("local.properties")
    if (file.isFile) file.inputStream().use { load(it) }
}

fun setting(name: String): String {
    val value = localProperties.getProperty(name) ?: (findProperty(name) as String?) ?: ""
    if (value.isBlank()) {
        throw GradleException(
            "set $name in android_demo/local.properties (see android_demo/README.md)"
        )
    }
    return value
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
                    "-DEXECUTORCH_ROOT=${setting("executorchAndroidPrefix")}",
                    "-Dexecutorch_DIR=${setting("executorchAndroidPrefix")}/lib/cmake/ExecuTorch",
                    "-Dnlohmann_json_DIR=${setting("nlohmannJsonAndroidDir")}",
                )
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
        // Native libraries stay uncompressed in the APK and are loaded from it directly.
        jniLibs.useLegacyPackaging = false
    }
}

kotlin {
    compilerOptions {
        jvmTarget.set(JvmTarget.JVM_17)
    }
}

// No AndroidX, no ExecuTorch Java API: the UI is framework widgets and every call goes through
// our JNI library to the C++ core, which links ExecuTorch's native libraries itself.
dependencies {}
