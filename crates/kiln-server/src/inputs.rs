//! Input images (img2img and inpainting's image, Kontext's, FLUX.2's references, masks): each
//! checked before its job is queued — its bytes, its pixel count from the header before it is
//! decoded, then decoded whole — and kept as a file the pipeline reads ([`FileRef`]).
//!
//! The files live in one folder the server makes at its first upload
//! (`$TMPDIR/kiln-serve-uploads-<pid>-XXXXXX`, readable by the server's user only), each named by
//! the sha256 of its bytes (`<sha256>.png`) and written under a temporary name, then renamed (a
//! pipeline never reads half a file). A file is shared by the jobs that give the same bytes and
//! removed once the last of them is dropped (a finished job is kept `--keep-images` seconds, or
//! until the server holds too many finished jobs), so the folder holds at most the files of the
//! live and kept jobs. The folder goes when the server exits; one a killed server left is removed
//! by the next server that makes its own (on Linux: its process is gone).

use std::collections::HashMap;
use std::io::{Cursor, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use axum::http::StatusCode;
use base64::Engine;
use kiln_pipelines::arguments::FileRef;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::request::{CallFields, JobRequest};
use crate::Limits;

/// The most input images one request may give.
pub const MAX_INPUT_IMAGES: usize = 16;

/// The most pixels an input image may have whatever `--max-input-pixels` says: the pipelines'
/// own bound (4096 × 4096).
pub const MAX_INPUT_PIXELS: u64 = kiln_pipelines::images::MAX_INPUT_PIXELS;

/// What the folder and its files share.
struct Folder {
    dir: tempfile::TempDir,
    /// The files by sha256: the id of the [`Upload`] that wrote it, and that upload.
    files: Mutex<HashMap<String, (u64, Weak<Upload>)>>,
    next_id: AtomicU64,
}

/// The upload folder (made at the first upload), and the bound on how many images are decoded
/// at once.
pub(crate) struct Uploads {
    folder: Mutex<Option<Arc<Folder>>>,
    /// The folder's path once made (for the server's last clean-up).
    made: Arc<Mutex<Option<PathBuf>>>,
    decoding: tokio::sync::Semaphore,
}

/// One stored input file; the file is removed when the last job holding it is dropped (and the
/// folder stays while a file of it is held: a job queued before a shutdown still runs).
#[derive(Debug)]
pub(crate) struct Upload {
    folder: Arc<Folder>,
    id: u64,
    pub sha256: String,
    pub path: PathBuf,
}

impl std::fmt::Debug for Folder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Folder").field("dir", &self.dir.path()).finish()
    }
}

impl Upload {
    /// How a call names it: its path and sha256.
    pub fn file_ref(&self) -> FileRef {
        FileRef {
            path: self.path.display().to_string(),
            sha256: Some(self.sha256.clone()),
        }
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        let mut files = self.folder.files.lock().unwrap_or_else(|e| e.into_inner());
        // A later upload of the same bytes may have written the file again meanwhile: it is
        // that one's to remove then.
        if files.get(&self.sha256).is_some_and(|(id, _)| *id == self.id) {
            files.remove(&self.sha256);
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// What an input image is for, which decides how it is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// An image: kept as sent.
    Image,
    /// A mask as diffusers takes it (white: repaint): kept as sent.
    Mask,
    /// An OpenAI mask: its fully transparent areas are the ones to edit. Stored as diffusers'
    /// mask (a grayscale PNG, `255 − alpha`); a mask without transparency (no alpha, or all
    /// opaque) is taken as diffusers' one (white: repaint).
    AlphaMask,
}

/// The start of the folders' names; the server's process id follows.
const FOLDER_PREFIX: &str = "kiln-serve-uploads-";

impl Uploads {
    pub fn new() -> Uploads {
        Uploads {
            folder: Mutex::new(None),
            made: Arc::new(Mutex::new(None)),
            // Decoding a large image takes memory and time: two at once, the others wait.
            decoding: tokio::sync::Semaphore::new(2),
        }
    }

    /// The folder's path once it is made (shared: it outlives this).
    pub fn made(&self) -> Arc<Mutex<Option<PathBuf>>> {
        self.made.clone()
    }

    /// The folder, made now the first time (under the system's temporary folder, as
    /// `kiln-serve-uploads-<pid>-XXXXXX`; the folders of servers no longer running, killed before
    /// they could remove theirs, are removed first).
    fn folder(&self) -> std::io::Result<Arc<Folder>> {
        let mut folder = self.folder.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(folder) = &*folder {
            return Ok(folder.clone());
        }
        remove_stale_folders();
        let dir = tempfile::Builder::new()
            .prefix(&format!("{FOLDER_PREFIX}{}-", std::process::id()))
            .tempdir()?;
        *self.made.lock().unwrap_or_else(|e| e.into_inner()) = Some(dir.path().to_path_buf());
        let made = Arc::new(Folder {
            dir,
            files: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
        });
        *folder = Some(made.clone());
        Ok(made)
    }

    /// Stores the bytes of an input image a former server checked (a queued job read back from
    /// `--jobs-db`).
    pub fn restore(&self, bytes: &[u8]) -> std::io::Result<Arc<Upload>> {
        store(&self.folder()?, bytes)
    }

    /// The files stored now.
    #[cfg(test)]
    pub fn count(&self) -> usize {
        let folder = self.folder.lock().unwrap();
        folder.as_ref().map_or(0, |f| f.files.lock().unwrap().len())
    }

    /// Checks image `bytes` (request field `field`) against `limits` — bytes, then the pixel
    /// count from its header — decodes it (off the async threads), and stores it. Every error
    /// names `field`.
    pub async fn take(
        &self,
        field: &str,
        bytes: Vec<u8>,
        role: Role,
        limits: &Limits,
    ) -> Result<Arc<Upload>, ApiError> {
        check_header(field, &bytes, limits)?;
        let _permit = self
            .decoding
            .acquire()
            .await
            .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down"))?;
        let folder = self.folder().map_err(|e| server_error(field, &e))?;
        let name = field.to_string();
        let max_pixels = limits.max_input_pixels.min(MAX_INPUT_PIXELS);
        tokio::task::spawn_blocking(move || -> Result<Arc<Upload>, ApiError> {
            let image = kiln_image::InputImage::decode(&bytes, &format!("`{name}`"), max_pixels)
                .map_err(|e| ApiError::bad_request(Some(&name), e.to_string()))?;
            let channels = usize::from(image.channels());
            let bytes = match role {
                // LA or RGBA (the alpha the last channel) with some transparency.
                Role::AlphaMask
                    if channels % 2 == 0 && image.data().chunks_exact(channels).any(|p| p[channels - 1] < 255) =>
                {
                    let alpha = image.data().chunks_exact(channels).map(|p| 255 - p[channels - 1]);
                    let mask = image::GrayImage::from_raw(image.width(), image.height(), alpha.collect())
                        .expect("one byte per pixel");
                    let mut png = Vec::new();
                    mask.write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
                        .map_err(|e| server_error(&name, &e))?;
                    png
                }
                _ => bytes,
            };
            store(&folder, &bytes).map_err(|e| server_error(&name, &e))
        })
        .await
        .map_err(|e| server_error(field, &e))?
    }
}

/// Removes the upload folders of this machine's servers that no longer run (on Linux, where
/// `/proc` tells; elsewhere a killed server's folder is left to the system's cleaning).
fn remove_stale_folders() {
    if !cfg!(target_os = "linux") {
        return;
    }
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(FOLDER_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn server_error(field: &str, e: &dyn std::fmt::Display) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("`{field}`: the server could not keep the image: {e}"),
    )
}

fn bad(field: &str, message: impl std::fmt::Display) -> ApiError {
    ApiError::bad_request(Some(field), format!("`{field}` {message}"))
}

/// The image's size from its header, checked: its bytes against `--max-image-bytes`, its format
/// known, its pixel count 1 to `--max-input-pixels`.
pub(crate) fn check_header(field: &str, bytes: &[u8], limits: &Limits) -> Result<(u32, u32), ApiError> {
    if bytes.is_empty() {
        return Err(bad(field, "is empty: send the image's bytes"));
    }
    if bytes.len() > limits.max_image_bytes {
        return Err(ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            ..bad(
                field,
                format!(
                    "has {} bytes; this server takes images of at most {} bytes (--max-image-bytes)",
                    bytes.len(),
                    limits.max_image_bytes
                ),
            )
        });
    }
    let reader = image::ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| bad(field, format!("cannot be read: {e}")))?;
    let Some(format) = reader.format() else {
        return Err(bad(
            field,
            format!(
                "is not an image kiln reads: send an image file ({})",
                readable_formats()
            ),
        ));
    };
    let (w, h) = reader.into_dimensions().map_err(|e| match e {
        image::ImageError::Unsupported(_) => bad(
            field,
            format!(
                "is a {format:?} image, which this kiln does not read: send an image file ({})",
                readable_formats()
            ),
        ),
        e => bad(field, format!("is not a whole image: its header cannot be read ({e})")),
    })?;
    let max = limits.max_input_pixels.min(MAX_INPUT_PIXELS);
    let pixels = u64::from(w) * u64::from(h);
    if pixels == 0 || pixels > max {
        return Err(bad(
            field,
            format!("is {w}×{h} pixels; this server takes input images of 1 to {max} pixels (--max-input-pixels)"),
        ));
    }
    Ok((w, h))
}

/// The formats this build reads ("PNG, JPEG, ...").
fn readable_formats() -> String {
    let names: Vec<String> = image::ImageFormat::all()
        .filter(image::ImageFormat::reading_enabled)
        .map(|f| format!("{f:?}").to_uppercase())
        .collect();
    names.join(", ")
}

/// Stores `bytes` as `<sha256>.<format's extension>` in the folder (or finds the file of the same
/// bytes stored).
fn store(folder: &Arc<Folder>, bytes: &[u8]) -> std::io::Result<Arc<Upload>> {
    let sha256: String = Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect();
    let lock = || folder.files.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(same) = lock().get(&sha256).and_then(|(_, upload)| upload.upgrade()) {
        return Ok(same);
    }
    let id = folder.next_id.fetch_add(1, Ordering::Relaxed);
    let extension = image::guess_format(bytes)
        .ok()
        .and_then(|f| f.extensions_str().first().copied())
        .unwrap_or("img");
    let path = folder.dir.path().join(format!("{sha256}.{extension}"));
    let part = folder.dir.path().join(format!(".{sha256}.{id}.part"));
    let written = std::fs::File::create(&part).and_then(|mut f| f.write_all(bytes));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&part);
        return Err(e);
    }
    let mut files = lock();
    if let Some(same) = files.get(&sha256).and_then(|(_, upload)| upload.upgrade()) {
        let _ = std::fs::remove_file(&part);
        return Ok(same);
    }
    if let Err(e) = std::fs::rename(&part, &path) {
        let _ = std::fs::remove_file(&part);
        return Err(e);
    }
    let upload = Arc::new(Upload {
        folder: folder.clone(),
        id,
        sha256: sha256.clone(),
        path,
    });
    files.insert(sha256, (id, Arc::downgrade(&upload)));
    Ok(upload)
}

/// The bytes of a base64 image (`data:image/png;base64,` prefix allowed, whitespace ignored);
/// an error names `field`.
pub(crate) fn from_base64(field: &str, text: &str) -> Result<Vec<u8>, ApiError> {
    let text = text.trim();
    let data = match text.strip_prefix("data:") {
        Some(rest) => match rest.split_once(',') {
            Some((kind, data)) if kind.ends_with(";base64") => data,
            _ => {
                return Err(bad(
                    field,
                    "is a data URL but not a base64 one: give `data:image/png;base64,...` or the base64 text alone",
                ))
            }
        },
        None => text,
    };
    let compact: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    base64::engine::general_purpose::STANDARD
        .decode(compact.as_bytes())
        .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(compact.as_bytes()))
        .or_else(|_| base64::engine::general_purpose::URL_SAFE.decode(compact.as_bytes()))
        .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(compact.as_bytes()))
        .map_err(|e| bad(field, format!("is not base64 image data: {e}")))
}

/// The input images of a request, in order, with the request's own names for them.
#[derive(Default)]
pub(crate) struct Inputs {
    /// The images' files, in order.
    pub images: Vec<Arc<Upload>>,
    pub mask: Option<Arc<Upload>>,
}

impl Inputs {
    /// The stored files a job holds while it lives.
    pub fn uploads(&self) -> Vec<Arc<Upload>> {
        self.images.iter().chain(&self.mask).cloned().collect()
    }
}

/// The pipeline class that runs model `model`'s calls with an input image (and a mask): its
/// folder's image-to-image or inpainting class, as diffusers' `AutoPipelineFor…` maps it.
pub(crate) fn kind_with_inputs(model: &crate::ModelInfo, image: bool, mask: bool) -> kiln_pipelines::PipelineKind {
    let call = kiln_pipelines::GenerateCall {
        image: image.then(|| vec![FileRef::new("image")]),
        mask_image: mask.then(|| FileRef::new("mask")),
        ..Default::default()
    };
    model.kind.for_call(&call)
}

/// The fields a request's images came in, for errors: the name of the request's image field and
/// of its mask field (`image`/`mask` for OpenAI, `init_images`/`mask` for A1111,
/// `image`/`mask_image` for the jobs API).
#[derive(Clone, Copy, Debug)]
pub(crate) struct InputNames {
    pub image: &'static str,
    pub mask: &'static str,
}

impl InputNames {
    /// `e` with the call argument it names (`image`, `mask_image`) written as the request's
    /// field.
    pub fn rename(self, e: ApiError) -> ApiError {
        let (argument, field) = match e.param.as_deref() {
            Some("image") => ("image", self.image),
            Some("mask_image") => ("mask_image", self.mask),
            _ => return e,
        };
        if argument == field {
            return e;
        }
        ApiError {
            message: e.message.replace(&format!("`{argument}`"), &format!("`{field}`")),
            param: Some(field.to_string()),
            ..e
        }
    }

    /// A refusal before any image is read when model `model` takes none of these inputs (a
    /// call with input images runs its folder's image-to-image or inpainting class, as
    /// diffusers' `AutoPipelineFor…` maps it).
    pub fn check_model(self, model: &crate::ModelInfo, image: bool, mask: bool) -> Result<(), ApiError> {
        let kind = kind_with_inputs(model, image, mask);
        let class = kind.class_name();
        if image && !kind.takes("image") {
            return Err(ApiError::bad_request(
                Some(self.image),
                format!(
                    "`{}`: model {} ({class}) takes no input image; use a model that does (image-to-image, inpainting, editing)",
                    self.image, model.name
                ),
            ));
        }
        if mask && !kind.takes("mask_image") {
            return Err(ApiError::bad_request(
                Some(self.mask),
                format!(
                    "`{}`: model {} ({class}) takes no mask (it does no inpainting); leave `{}` out",
                    self.mask, model.name, self.mask
                ),
            ));
        }
        if mask && !image {
            return Err(ApiError::bad_request(
                Some(self.image),
                format!(
                    "`{}` is given without `{}`: a mask needs the image it masks",
                    self.mask, self.image
                ),
            ));
        }
        Ok(())
    }
}

/// The input images a request sent (as bytes, none decoded yet) and its names for them.
pub(crate) struct Sent {
    /// (field, bytes) per image, in order.
    pub images: Vec<(String, Vec<u8>)>,
    pub mask: Option<(String, Vec<u8>)>,
    /// How the mask is to be read.
    pub mask_role: Role,
    pub names: InputNames,
}

/// What a request asks besides its input images (as [`JobRequest::new`] takes it).
pub(crate) struct Draw {
    pub model: usize,
    pub prompt: String,
    /// (height, width) as given.
    pub size: (Option<usize>, Option<usize>),
    pub fields: CallFields,
    pub seeds: Vec<u64>,
}

impl crate::App {
    /// The checked request of `draw` with the input images `sent`, and the images (stored).
    /// Everything is checked before any image is decoded: the number of images, whether the
    /// model takes them, each one's bytes and pixel count (from its header), and the request
    /// itself; then each image is decoded and stored. Without a size, the output takes the first
    /// image's (as `kiln generate --image`). Errors name the request's own fields.
    pub(crate) async fn request_with_inputs(&self, draw: Draw, sent: Sent) -> Result<(JobRequest, Inputs), ApiError> {
        let Draw {
            model,
            prompt,
            size,
            mut fields,
            seeds,
        } = draw;
        let info = &self.models[model];
        let names = sent.names;
        if sent.images.is_empty() && sent.mask.is_none() {
            let request = JobRequest::new(model, info, prompt, size, fields, seeds, &self.limits)?;
            return Ok((request, Inputs::default()));
        }
        if sent.images.len() > MAX_INPUT_IMAGES {
            return Err(ApiError::bad_request(
                Some(names.image),
                format!(
                    "`{}` gives {} images; this server takes at most {MAX_INPUT_IMAGES} per request",
                    names.image,
                    sent.images.len()
                ),
            ));
        }
        names.check_model(info, !sent.images.is_empty(), sent.mask.is_some())?;
        let mut sizes = Vec::new();
        for (field, bytes) in sent.images.iter().chain(&sent.mask) {
            sizes.push(check_header(field, bytes, &self.limits)?);
        }
        let (w, h) = sizes[0];
        let size_from_input = size == (None, None);
        let size = (size.0.or(Some(h as usize)), size.1.or(Some(w as usize)));
        let build = |fields: CallFields| -> Result<JobRequest, ApiError> {
            let mut request = JobRequest::new(model, info, prompt.clone(), size, fields, seeds.clone(), &self.limits)
                .map_err(|e| match e.param.as_deref() {
                    Some(side @ ("height" | "width")) if size_from_input => ApiError::bad_request(
                        Some(names.image),
                        format!(
                            "`{}` is {w}×{h}, and without a size the output takes the input image's: {}; give a smaller image, or a size",
                            names.image,
                            e.message.replace(&format!("`{side}`"), &format!("its {side}"))
                        ),
                    ),
                    _ => names.rename(e),
                })?;
            request.size_from_input = size_from_input;
            Ok(request)
        };
        // The request's own checks first, with stand-ins for the files.
        let mut standing_in = fields.clone();
        set_inputs(
            &mut standing_in,
            (0..sent.images.len())
                .map(|k| FileRef::new(format!("input image {k}")))
                .collect(),
            sent.mask.as_ref().map(|_| FileRef::new("input mask")),
        )?;
        build(standing_in)?;
        let mut inputs = Inputs::default();
        for (field, bytes) in sent.images {
            inputs
                .images
                .push(self.uploads.take(&field, bytes, Role::Image, &self.limits).await?);
        }
        if let Some((field, bytes)) = sent.mask {
            inputs.mask = Some(self.uploads.take(&field, bytes, sent.mask_role, &self.limits).await?);
        }
        set_inputs(
            &mut fields,
            inputs.images.iter().map(|u| u.file_ref()).collect(),
            inputs.mask.as_ref().map(|m| m.file_ref()),
        )?;
        Ok((build(fields)?, inputs))
    }
}

/// Sets the call's `image` (when any) and `mask_image`.
pub(crate) fn set_inputs(fields: &mut CallFields, images: Vec<FileRef>, mask: Option<FileRef>) -> Result<(), ApiError> {
    use kiln_pipelines::arguments::{File, Item};
    if !images.is_empty() {
        fields.set("image", &Value::Array(images.iter().map(File::to_json).collect()))?;
    }
    if let Some(mask) = mask {
        fields.set("mask_image", &File::to_json(&mask))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let image = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut bytes = Vec::new();
        image
            .write_to(&mut Cursor::new(&mut bytes), image::ImageFormat::Png)
            .unwrap();
        bytes
    }

    /// A PNG whose header says `w`×`h` (its data is not that image's).
    fn png_header_saying(w: u32, h: u32) -> Vec<u8> {
        let mut bytes = png(4, 4);
        bytes[16..20].copy_from_slice(&w.to_be_bytes());
        bytes[20..24].copy_from_slice(&h.to_be_bytes());
        // The IHDR chunk's CRC, so that the header reads.
        let crc = crc32(&bytes[12..29]);
        bytes[29..33].copy_from_slice(&crc.to_be_bytes());
        bytes
    }

    fn crc32(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    fn field_of(e: ApiError) -> (u16, String, String) {
        (e.status.as_u16(), e.param.unwrap_or_default(), e.message)
    }

    #[test]
    fn the_header_is_checked_before_decoding() {
        let limits = Limits::default();
        assert_eq!(check_header("image", &png(32, 16), &limits).unwrap(), (32, 16));
        let (code, param, message) = field_of(check_header("image", &[], &limits).unwrap_err());
        assert_eq!((code, param.as_str()), (400, "image"), "{message}");
        let (code, param, message) = field_of(check_header("mask", b"hello, not an image", &limits).unwrap_err());
        assert_eq!((code, param.as_str()), (400, "mask"), "{message}");
        assert!(message.contains("not an image"), "{message}");
        // A header that says 65536×65536: refused before anything is decoded.
        let huge = png_header_saying(65536, 65536);
        let (code, param, message) = field_of(check_header("image[]", &huge, &limits).unwrap_err());
        assert_eq!((code, param.as_str()), (400, "image[]"), "{message}");
        assert!(message.contains("65536×65536"), "{message}");
        let zero = png_header_saying(0, 0);
        let (code, param, message) = field_of(check_header("init_images[0]", &zero, &limits).unwrap_err());
        assert_eq!((code, param.as_str()), (400, "init_images[0]"), "{message}");
        let small = Limits {
            max_image_bytes: 10,
            ..Limits::default()
        };
        let (code, param, _) = field_of(check_header("image", &png(4, 4), &small).unwrap_err());
        assert_eq!((code, param.as_str()), (413, "image"));
        let few_pixels = Limits {
            max_input_pixels: 100,
            ..Limits::default()
        };
        assert!(check_header("image", &png(10, 10), &few_pixels).is_ok());
        assert!(check_header("image", &png(11, 10), &few_pixels).is_err());
    }

    #[test]
    fn base64_with_or_without_a_data_url_prefix() {
        let bytes = png(2, 2);
        let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
        assert_eq!(from_base64("image", &b64).unwrap(), bytes);
        assert_eq!(
            from_base64("image", &format!("data:image/png;base64,{b64}")).unwrap(),
            bytes
        );
        let e = from_base64("init_images[1]", "not base64!").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("init_images[1]"));
        let e = from_base64("mask", "data:text/plain,hello").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("mask"));
    }

    #[test]
    fn files_are_named_by_sha256_shared_and_removed_with_their_last_holder() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let uploads = Uploads::new();
        assert!(
            uploads.made().lock().unwrap().is_none(),
            "no folder before the first upload"
        );
        let limits = Limits::default();
        let bytes = png(8, 8);
        let a = runtime
            .block_on(uploads.take("image", bytes.clone(), Role::Image, &limits))
            .unwrap();
        let b = runtime
            .block_on(uploads.take("image", bytes.clone(), Role::Image, &limits))
            .unwrap();
        assert!(Arc::ptr_eq(&a, &b), "the same bytes share a file");
        let path = a.path.clone();
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        let sha: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(path.file_name().unwrap().to_str().unwrap(), format!("{sha}.png"));
        assert_eq!(a.file_ref().sha256.as_deref(), Some(sha.as_str()));
        // No half file is left beside it.
        let dir = uploads.made().lock().unwrap().clone().unwrap();
        let name = dir.file_name().unwrap().to_str().unwrap().to_string();
        assert!(
            name.starts_with(&format!("kiln-serve-uploads-{}-", std::process::id())),
            "{name}"
        );
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        drop(a);
        assert!(path.exists(), "still held by b");
        drop(b);
        assert!(!path.exists(), "removed with its last holder");
        assert_eq!(uploads.count(), 0);
        // A truncated image is refused, naming its field, and nothing is kept.
        let truncated = bytes[..bytes.len() - 20].to_vec();
        let e = runtime
            .block_on(uploads.take("image[]", truncated, Role::Image, &limits))
            .unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.param.as_deref()),
            (400, Some("image[]")),
            "{}",
            e.message
        );
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        drop(uploads);
        assert!(!dir.exists(), "the folder goes with the server");
    }

    #[test]
    fn an_openai_mask_becomes_diffusers_mask() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let uploads = Uploads::new();
        // Left half transparent (edit), right half opaque (keep).
        let rgba = image::RgbaImage::from_fn(4, 2, |x, _| image::Rgba([9, 9, 9, if x < 2 { 0 } else { 255 }]));
        let mut bytes = Vec::new();
        rgba.write_to(&mut Cursor::new(&mut bytes), image::ImageFormat::Png)
            .unwrap();
        let mask = runtime
            .block_on(uploads.take("mask", bytes, Role::AlphaMask, &Limits::default()))
            .unwrap();
        let stored = image::open(&mask.path).unwrap().to_luma8();
        assert_eq!(stored.as_raw(), &[255, 255, 0, 0, 255, 255, 0, 0]);
        // An opaque one is diffusers' mask as it is.
        let opaque = image::RgbaImage::from_fn(4, 2, |x, _| {
            image::Rgba(if x < 2 { [255, 255, 255, 255] } else { [0, 0, 0, 255] })
        });
        let mut bytes = Vec::new();
        opaque
            .write_to(&mut Cursor::new(&mut bytes), image::ImageFormat::Png)
            .unwrap();
        let mask = runtime
            .block_on(uploads.take("mask", bytes.clone(), Role::AlphaMask, &Limits::default()))
            .unwrap();
        assert_eq!(std::fs::read(&mask.path).unwrap(), bytes);
    }
}
