//! The call's budget, checked before any allocation: steps, images (prompts × images per
//! prompt), pixels per side and per image, and the images' bytes against the device's memory.
//! Each limit is a sane maximum, far above what the models are trained for; a value past it is
//! refused with a message naming the argument, the value, the limit and what to do, instead of
//! a capacity overflow, an abort on a terabyte allocation or a run of hours.

/// Denoising steps (flow-matching models are trained for 1–50; a schedule finer than 10 000
/// steps changes nothing but the time).
pub const MAX_STEPS: usize = 10_000;
/// Images in one call: prompts × images per prompt.
pub const MAX_IMAGES: usize = 256;
/// Pixels per side of an image.
pub const MAX_SIDE: usize = 16_384;
/// Pixels per image (4096 × 4096; the models draw 1–2 megapixels).
pub const MAX_PIXELS: usize = 4096 * 4096;
/// Prompts in one call.
pub const MAX_PROMPTS: usize = MAX_IMAGES;

/// What a call asks for, as far as the budget goes. `height`/`width` 0 mean the model's default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallBudget {
    pub num_inference_steps: usize,
    /// Prompts (or rows of `prompt_embeds`).
    pub batch: usize,
    pub num_images_per_prompt: usize,
    pub height: usize,
    pub width: usize,
}

/// An argument past its limit: `argument` is the call's keyword (`num_inference_steps`); the
/// command line names it as its flag (see [`OverBudget::message`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverBudget {
    pub argument: &'static str,
    /// The value, as given (or the product, for a count of images or pixels).
    pub value: String,
    pub limit: String,
    /// What to do.
    pub advice: &'static str,
}

impl OverBudget {
    /// The message, with the argument shown as `name` (a keyword in backticks, or a flag).
    pub fn message(&self, name: &str) -> String {
        format!(
            "{name} {} is more than kiln allows ({}): {}",
            self.value, self.limit, self.advice
        )
    }
}

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message(&format!("`{}`", self.argument)))
    }
}

impl CallBudget {
    /// The first argument past its sane maximum.
    pub fn check(&self) -> Result<(), OverBudget> {
        if self.num_inference_steps > MAX_STEPS {
            return Err(OverBudget {
                argument: "num_inference_steps",
                value: self.num_inference_steps.to_string(),
                limit: format!("at most {MAX_STEPS} steps"),
                advice: "use fewer steps (these models are made for 1 to 50)",
            });
        }
        if self.batch > MAX_PROMPTS {
            return Err(OverBudget {
                argument: "prompt",
                value: format!("given {} times", self.batch),
                limit: format!("at most {MAX_PROMPTS} prompts in one call"),
                advice: "split the prompts over several calls",
            });
        }
        if self.num_images_per_prompt > MAX_IMAGES {
            return Err(OverBudget {
                argument: "num_images_per_prompt",
                value: self.num_images_per_prompt.to_string(),
                limit: format!("at most {MAX_IMAGES} images in one call"),
                advice: "make fewer images per call, or several calls with other seeds",
            });
        }
        let images = self.batch.saturating_mul(self.num_images_per_prompt);
        if images > MAX_IMAGES {
            return Err(OverBudget {
                argument: "num_images_per_prompt",
                value: format!(
                    "{} with {} prompts ({images} images)",
                    self.num_images_per_prompt, self.batch
                ),
                limit: format!("at most {MAX_IMAGES} images in one call"),
                advice: "make fewer images per prompt or split the prompts over several calls",
            });
        }
        for (argument, side) in [("height", self.height), ("width", self.width)] {
            if side > MAX_SIDE {
                return Err(OverBudget {
                    argument,
                    value: side.to_string(),
                    limit: format!("at most {MAX_SIDE} pixels per side"),
                    advice: "draw a smaller image (these models are made for about 1024×1024)",
                });
            }
        }
        let pixels = self.height.saturating_mul(self.width);
        if pixels > MAX_PIXELS {
            return Err(OverBudget {
                argument: "height",
                value: format!("{} (with a width of {}: {pixels} pixels)", self.height, self.width),
                limit: format!("at most {MAX_PIXELS} pixels (4096×4096) per image"),
                advice: "draw a smaller image (these models are made for about 1024×1024)",
            });
        }
        Ok(())
    }

    /// The bytes the call's images take at the least on the device: the decoded batch in f32
    /// (3 channels per pixel), which the decoder's last layer writes while its input is alive.
    pub fn image_bytes(&self, default_size: usize) -> u64 {
        let side = |s: usize| (if s == 0 { default_size } else { s }) as u64;
        let images = (self.batch as u64).saturating_mul(self.num_images_per_prompt as u64);
        images
            .saturating_mul(side(self.height))
            .saturating_mul(side(self.width))
            .saturating_mul(3 * 4 * 2)
    }

    /// [`CallBudget::check`], then the images' bytes against `free` device bytes (when the device
    /// reports a budget: its memory or `KILN_DEVICE_MEMORY_LIMIT`).
    pub fn check_memory(&self, default_size: usize, free: Option<u64>) -> Result<(), OverBudget> {
        self.check()?;
        let need = self.image_bytes(default_size);
        match free {
            Some(free) if need > free => Err(OverBudget {
                argument: "num_images_per_prompt",
                value: format!(
                    "{} with {} prompts at {}×{} pixels (at least {} MiB for the images alone)",
                    self.num_images_per_prompt,
                    self.batch,
                    if self.height == 0 { default_size } else { self.height },
                    if self.width == 0 { default_size } else { self.width },
                    need.div_ceil(1 << 20)
                ),
                limit: format!(
                    "the device has {} MiB free, by its memory or KILN_DEVICE_MEMORY_LIMIT",
                    free >> 20
                ),
                advice: "make fewer or smaller images per call, or try OffloadMode::Model",
            }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok() -> CallBudget {
        CallBudget {
            num_inference_steps: 28,
            batch: 2,
            num_images_per_prompt: 4,
            height: 1024,
            width: 1024,
        }
    }

    #[test]
    fn within_the_limits_passes_and_each_limit_names_its_argument() {
        assert_eq!(ok().check(), Ok(()));
        let at_limits = CallBudget {
            num_inference_steps: MAX_STEPS,
            batch: 1,
            num_images_per_prompt: MAX_IMAGES,
            height: 4096,
            width: 4096,
        };
        assert_eq!(at_limits.check(), Ok(()));
        let over = |b: CallBudget| b.check().unwrap_err();
        let steps = over(CallBudget {
            num_inference_steps: usize::MAX,
            ..ok()
        });
        assert_eq!(steps.argument, "num_inference_steps");
        assert_eq!(
            steps.to_string(),
            format!(
                "`num_inference_steps` {} is more than kiln allows (at most 10000 steps): use fewer steps (these models are made for 1 to 50)",
                usize::MAX
            )
        );
        let images = over(CallBudget {
            batch: 3,
            num_images_per_prompt: 100,
            ..ok()
        });
        assert_eq!(images.argument, "num_images_per_prompt");
        assert!(images.value.contains("300 images"), "{images}");
        assert_eq!(
            over(CallBudget {
                num_images_per_prompt: 100_000,
                ..ok()
            })
            .argument,
            "num_images_per_prompt"
        );
        assert_eq!(over(CallBudget { batch: 1000, ..ok() }).argument, "prompt");
        let tall = over(CallBudget {
            height: 1 << 20,
            width: 16,
            ..ok()
        });
        assert_eq!((tall.argument, tall.value.as_str()), ("height", "1048576"));
        let wide = over(CallBudget {
            height: 16,
            width: MAX_SIDE + 1,
            ..ok()
        });
        assert_eq!(wide.argument, "width");
        let big = over(CallBudget {
            height: 8192,
            width: 8192,
            ..ok()
        });
        assert!(
            big.message("HEIGHT")
                .starts_with("HEIGHT 8192 (with a width of 8192: 67108864 pixels) is more than kiln allows"),
            "{big}"
        );
    }

    #[test]
    fn images_that_cannot_fit_the_device_are_refused_before_any_work() {
        let b = ok();
        // 8 images of 1024² f32 RGB, twice.
        assert_eq!(b.image_bytes(512), 8 * 1024 * 1024 * 24);
        assert_eq!(b.check_memory(512, None), Ok(()));
        assert_eq!(b.check_memory(512, Some(1 << 40)), Ok(()));
        let e = b.check_memory(512, Some(100 << 20)).unwrap_err();
        assert!(e.to_string().contains("the device has 100 MiB free"), "{e}");
        // The model's default size stands for 0.
        let default = CallBudget {
            height: 0,
            width: 0,
            ..ok()
        };
        assert_eq!(default.image_bytes(64), 8 * 64 * 64 * 24);
    }
}
