//! The windows of a part's rows, built without a heap allocation per window.
//!
//! A window here is [`crate::summary::Cell`]'s fields with the values at its last step kept as
//! a range of one buffer shared by a metric's windows ([`Windows::last_values`]), sorted by
//! `f64::total_cmp` once when the window is built. Every field merges exactly and in any order
//! (counts add, extremes compare in a total order, the last step's values are those of the
//! latest window), so what is built here equals, bit for bit, the `Cell` built row by row — the
//! reference the tests hold it to. A `Cell` per window (a `SmallVec` of last values, spilled to
//! the heap for a pooled window of many ranks, cloned at every coarser level) made summarising
//! the largest single part of a flush.
//!
//! - A series' windows come straight from its rows, which ascend by step in a sorted part.
//! - A pooled group's windows (every rank of a (metric, layer, site)) come from its rows in
//!   any order: each row finds its window through a table indexed by window (dense steps) or a
//!   sorted list of the windows (sparse ones), then a second pass gathers the values at each
//!   window's last step.
//! - A coarser level merges consecutive windows of a finer one.

/// One window's summary; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Window {
    pub(super) start: u64,
    pub(super) count: u64,
    pub(super) nonfinite: u64,
    /// Over the finite values; meaningless when there are none (`count == nonfinite`).
    pub(super) min: f64,
    pub(super) max: f64,
    pub(super) last_step: u64,
    /// The values at `last_step`, sorted: `offset..offset + len` of [`Windows::last_values`].
    pub(super) last: (u32, u32),
}

impl Window {
    fn empty(start: u64) -> Window {
        Window {
            start,
            count: 0,
            nonfinite: 0,
            min: 0.0,
            max: 0.0,
            last_step: 0,
            last: (0, 0),
        }
    }

    /// The finite extremes, if any.
    pub(super) fn extremes(&self) -> Option<(f64, f64)> {
        (self.count > self.nonfinite).then_some((self.min, self.max))
    }

    /// Counts `value`; the caller keeps `last_step` and `last`.
    fn add(&mut self, value: f64) {
        if value.is_finite() {
            self.widen(value, value);
        } else {
            self.nonfinite += 1;
        }
        self.count += 1;
    }

    /// Includes finite extremes `min..=max`, in `f64::total_cmp`'s order (−0 below +0, so a
    /// zero extreme's sign does not depend on the rows' order). Before `count` grows.
    fn widen(&mut self, min: f64, max: f64) {
        if self.count == self.nonfinite {
            (self.min, self.max) = (min, max);
        } else {
            self.min = std::cmp::min_by(self.min, min, f64::total_cmp);
            self.max = std::cmp::max_by(self.max, max, f64::total_cmp);
        }
    }

    /// Merges `later`, a window of steps after all of this one's.
    fn absorb_later(&mut self, later: &Window) {
        if let Some((min, max)) = later.extremes() {
            self.widen(min, max);
        }
        self.count += later.count;
        self.nonfinite += later.nonfinite;
        self.last_step = later.last_step;
        self.last = later.last;
    }
}

/// The windows of a part's series and pooled groups, and the buffer their last values are in.
#[derive(Debug, Default)]
pub(super) struct Windows {
    pub(super) last_values: Vec<f64>,
}

impl Windows {
    /// The values at `window`'s last step, ascending by `f64::total_cmp`.
    pub(super) fn last_of(&self, window: &Window) -> &[f64] {
        let (offset, len) = window.last;
        &self.last_values[offset as usize..(offset + len) as usize]
    }

    /// Forgets every window's last values (once the windows are pushed to their outputs).
    pub(super) fn clear(&mut self) {
        self.last_values.clear();
    }

    /// Keeps `values` as a window's last values (sorted); returns their range.
    fn keep(&mut self, values: &[f64]) -> (u32, u32) {
        let offset = self.last_values.len();
        self.last_values.extend_from_slice(values);
        sort(&mut self.last_values[offset..]);
        (offset as u32, values.len() as u32)
    }

    /// Appends to `out` the windows of `2^shift` steps of one series' rows (`steps` with their
    /// `values`), whose steps ascend.
    pub(super) fn of_series(
        &mut self,
        steps: &[u64],
        values: &[f64],
        shift: u32,
        out: &mut Vec<Window>,
    ) {
        let mut i = 0;
        while i < steps.len() {
            let mut window = Window::empty(steps[i] >> shift << shift);
            // The first row at the window's current last step.
            let mut at_last = i;
            while i < steps.len() && steps[i] >> shift << shift == window.start {
                if steps[i] != steps[at_last] {
                    at_last = i;
                }
                window.add(values[i]);
                i += 1;
            }
            window.last_step = steps[at_last];
            window.last = self.keep(&values[at_last..i]);
            out.push(window);
        }
    }

    /// Appends to `out` the windows of `2^shift` steps of rows (`steps` with their `values`)
    /// taken together, in any order (a pooled group: each rank's rows in turn).
    pub(super) fn of_group(
        &mut self,
        steps: &[u64],
        values: &[f64],
        shift: u32,
        out: &mut Vec<Window>,
    ) {
        let Some(&lowest) = steps.iter().min() else {
            return;
        };
        let highest = steps.iter().copied().max().unwrap_or(lowest);
        let (first, last) = (lowest >> shift, highest >> shift);
        // Each row's window as an index into `windows`, which ascend by start.
        let first_out = out.len();
        let span = last - first + 1;
        let index: Vec<u32> = if span <= 4 * steps.len() as u64 + 1024 {
            // Dense: a slot per window in the span, numbered in order where a row falls.
            const EMPTY: u32 = u32::MAX;
            const HELD: u32 = u32::MAX - 1;
            let mut slot = vec![EMPTY; span as usize];
            for &step in steps {
                slot[((step >> shift) - first) as usize] = HELD;
            }
            for (offset, s) in slot.iter_mut().enumerate() {
                if *s == HELD {
                    *s = (out.len() - first_out) as u32;
                    out.push(Window::empty((first + offset as u64) << shift));
                }
            }
            steps
                .iter()
                .map(|&step| slot[((step >> shift) - first) as usize])
                .collect()
        } else {
            // Sparse: the distinct windows sorted, each row's found by binary search.
            let mut starts: Vec<u64> = steps.iter().map(|&s| s >> shift).collect();
            starts.sort_unstable();
            starts.dedup();
            out.extend(starts.iter().map(|&w| Window::empty(w << shift)));
            steps
                .iter()
                .map(|&step| starts.partition_point(|&w| w < step >> shift) as u32)
                .collect()
        };
        let windows = &mut out[first_out..];
        for ((&step, &value), &w) in steps.iter().zip(values).zip(&index) {
            let window = &mut windows[w as usize];
            // An empty window's `last_step` is 0, below any step.
            window.last_step = window.last_step.max(step);
            window.add(value);
        }
        // The values at each window's last step, placed by counting: `next[w]` counts window
        // w's, then (summed) is where they start, then where the next of them goes.
        let mut next = vec![0u32; windows.len() + 1];
        for (&step, &w) in steps.iter().zip(&index) {
            if step == windows[w as usize].last_step {
                next[w as usize + 1] += 1;
            }
        }
        let base = self.last_values.len() as u32;
        for w in 0..windows.len() {
            windows[w].last = (base + next[w], next[w + 1]);
            next[w + 1] += next[w];
            next[w] += base;
        }
        self.last_values
            .resize((base + next[windows.len()]) as usize, 0.0);
        for ((&step, &value), &w) in steps.iter().zip(values).zip(&index) {
            if step == windows[w as usize].last_step {
                self.last_values[next[w as usize] as usize] = value;
                next[w as usize] += 1;
            }
        }
        for window in windows.iter() {
            let (offset, len) = window.last;
            sort(&mut self.last_values[offset as usize..(offset + len) as usize]);
        }
    }
}

/// Sorts a window's last values into their one order.
fn sort(values: &mut [f64]) {
    if values.len() > 1 {
        values.sort_unstable_by(f64::total_cmp);
    }
}

/// The windows of `2^shift` steps (coarser than `fine`'s) that the ascending windows `fine`
/// make, appended to `out`.
pub(super) fn coarsen(fine: &[Window], shift: u32, out: &mut Vec<Window>) {
    let first_out = out.len();
    for window in fine {
        let start = window.start >> shift << shift;
        match out[first_out..].last_mut() {
            Some(coarse) if coarse.start == start => coarse.absorb_later(window),
            _ => out.push(Window { start, ..*window }),
        }
    }
}

/// Adds to `counts[level]` how many windows of each level in `levels` the ascending windows
/// `fine` (finer) make, without building them.
pub(super) fn count(
    fine: &[Window],
    levels: std::ops::RangeInclusive<u32>,
    counts: &mut [usize; 17],
) {
    for level in levels {
        let mut previous = None;
        for window in fine {
            let coarse = Some(window.start >> level);
            if coarse != previous {
                counts[level as usize] += 1;
                previous = coarse;
            }
        }
    }
}
