//! What follows a step of a reconcile pass: its own file, so that the steps (`act`,
//! `adopt`) name it without naming each other.

use kube::runtime::controller::Action;

/// What follows a step.
#[derive(Debug)]
pub(super) enum Next {
    /// Observe and plan again now (after a Create, or a replacement that creates
    /// at once).
    Again,
    /// This reconcile is done.
    Done(Action),
}
