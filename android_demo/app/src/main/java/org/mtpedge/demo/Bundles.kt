package org.mtpedge.demo

import android.content.Context
import java.io.File

/** Where bundles are looked for: where `adb push` (and mtp-profile) put them, then app storage. */
fun bundleRoots(context: Context): List<File> = listOfNotNull(
    File("/data/local/tmp/mtp"),
    context.getExternalFilesDir(null)?.let { File(it, "bundles") },
    File(context.filesDir, "bundles"),
)

/** Directories holding a manifest.json: each root itself and its subdirectories. */
fun findBundles(context: Context): List<File> =
    bundleRoots(context).flatMap { root ->
        val children = root.listFiles()?.filter { it.isDirectory }?.sortedBy { it.name }.orEmpty()
        (listOf(root) + children).filter { File(it, "manifest.json").isFile }
    }
