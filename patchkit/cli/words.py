"""The words of every code: where a reason (:class:`patchkit.codes.Reason`) becomes a sentence.

Below the command line a state's reason, a warning, a notice or a refusal is a code
and its facts; here, and only here, each code gets its words, made from its facts
alone (nothing is cut out of another sentence). A refusal ends with what it left
changed (``nothing``): "nothing was changed", or, after a run first rolled back an
interrupted one, "nothing else was changed". ``tests/test_json_contract.py`` checks
that every code has words.
"""

from __future__ import annotations

import shlex

from patchkit.cli import (
    adapter_words,
    cache_words,
    canary_words,
    doctor_words,
    lock_words,
    next_words,
    probe_words,
    runner_words,
    untested_words,
    verify_words,
)
from patchkit.cli.wordbook import Words, registrar
from patchkit.codes import Code, Line, Reason

NOTHING = "nothing was changed"
NOTHING_ELSE = "nothing else was changed"

WORDS: dict[Code, Words] = {}

# codes whose one fact ``text`` is their words: an error's line (made where it was raised,
# its kind's facts beside it), the catalogue's own text, and the adapter codes whose
# words are the finding's own (adapter_words.py words the others)
TEXT = (
    Code.ERROR,
    Code.USAGE,
    Code.INTERNAL_ERROR,
    Code.INTERRUPTED,
    Code.VLLM_NOT_FOUND,
    Code.RUNNER_NOT_HOOKED,
    Code.DECIDED,  # the catalogue's own text for its decision
    *(
        code
        for code in Code
        if code.value.startswith("adapter-") and code not in adapter_words.WORDS
    ),
)


def say(reason: Reason, nothing: str = NOTHING) -> str:
    """The words of ``reason`` (a refusal's end: ``nothing``)."""
    if its_own_words(reason):
        return reason["text"]
    return WORDS[reason.code](reason, nothing)


def its_own_words(reason: Reason) -> bool:
    """Whether ``reason``'s fact ``text`` is its words: a TEXT code's, or an error's line."""
    return reason.code in TEXT or isinstance(reason, Line)


def said(reason: Reason | None, nothing: str = NOTHING) -> str:
    """:func:`say`, or '' for no reason (a row with nothing to add)."""
    return "" if reason is None else say(reason, nothing)


words = registrar(WORDS)


def reinstall(r: Reason) -> str:
    """The way back to vLLM's own files a refusal names: "reinstall vLLM (`COMMAND`)", or
    in a git checkout git's stash of the changes to them (patchkit.vllmtree.reinstall)."""
    command = r["reinstall_command"]
    if r.get("reinstall_by") == "git":
        return (
            f"put vLLM's files back as the checkout's HEAD has them (`{command}`; the changes "
            "are kept in a stash)"
        )
    return f"reinstall vLLM (`{command}`)"


def headline(reason: Reason) -> str:
    """What a conflict is, without the way out: the words revert's refusal of an edited
    file starts with."""
    r = reason
    if r.code == Code.EDITED:
        return f"{r['path']} was edited after patchkit applied {r['top']}"
    if r.code == Code.FOREIGN_BACKUP:
        return (
            f"{r['path']} is neither what {r['top']} wrote nor vLLM {r['version']}'s own file "
            "(RECORD), and its backup is another release's file"
        )
    return said(r)


# ----- a patch's state, why -----


@words(Code.PREDATES_CATALOGUE)
def _predates(r: Reason, _: str) -> str:
    return (
        f"vLLM {r['version']} predates the releases this catalogue covers ({r['tested']}): the "
        "code this patch fixes is not in it"
    )


@words(Code.APPLIED_FROM_OLDER_CATALOGUE)
def _older(r: Reason, _: str) -> str:
    return (
        f"applied from an older catalogue: `patchkit apply --only {r['patch']}` brings the "
        "current one"
    )


@words(Code.APPLIED_WITHOUT_ENTRY)
def _no_record(r: Reason, _: str) -> str:
    return (
        "the patched text is present but patchkit has no record of applying it (applied by "
        "hand, or .patchkit/ was removed); revert reverse-applies the diff"
    )


@words(Code.APPLIED_IN_COMMIT)
def _in_commit(r: Reason, _: str) -> str:
    return f"applied in commit {r['commit']} (git history)"


@words(Code.REPLACED)
def _replaced(r: Reason, _: str) -> str:
    return "replaced the version applied from an older catalogue"


@words(Code.OPT_IN)
def _opt_in(r: Reason, _: str) -> str:
    return (
        f"not applied; a diagnostic: after `patchkit apply`, `patchkit apply --only "
        f"{r['patch']}` adds it (alone, it applies only itself)"
    )


@words(Code.UNDER_LATER_PATCH)
def _under_later(r: Reason, _: str) -> str:
    return (
        f"{r['above']}, later in the series, is applied on {r['path']}: revert it first "
        "(patches stack in series order)"
    )


@words(Code.FOREIGN_BACKUP)
def _foreign(r: Reason, _: str) -> str:
    return f"{headline(r)}; {reinstall(r)}, then `patchkit revert` drops the old record"


@words(Code.UNKNOWN_PATCH_ON_TOP)
def _unknown_on_top(r: Reason, _: str) -> str:
    return (
        f"{r['path']} carries {r['top']!r}, a patch this patchkit does not know, on top: "
        "revert that with the patchkit that applied it first"
    )


@words(Code.EDITED)
def _edited(r: Reason, _: str) -> str:
    top, target = r["top"], f"--target {r['target']}"
    keep = (
        f"; to keep the edit in the patch, `patchkit refresh {top} {target}` rewrites its "
        "diff from the tree (CONTRIBUTING.md, 'Changing a patch')"
        if r["refresh"]
        else ""
    )
    if r["refusal"] is not None:
        return f"{headline(r)}; {say(r['refusal'])}{keep}"
    return (
        f"{headline(r)}; `patchkit revert --only {top} --force {target}` restores the "
        f"original and discards the edit{keep}"
    )


@words(Code.OTHER_RELEASE_INSTALLED, Code.PARTLY_REINSTALLED)
def _partly(r: Reason, _: str) -> str:
    if r.code == Code.OTHER_RELEASE_INSTALLED:
        what = (
            f"vLLM was reinstalled ({r['version']} now, {r['recorded']} when {r['patch']} was "
            f"applied) and {r['path']} is that release's file"
        )
    else:
        what = (
            f"{r['path']} is back to its original (or is gone) while the rest of {r['patch']} "
            "is applied (vLLM partly reinstalled, or a file patchkit created was deleted)"
        )
    rest = ", ".join(r["rest"])
    return f"{what}; `patchkit revert --only {r['top']}` removes the rest ({rest})"


@words(Code.DIFFERS_FROM_RECORD)
def _differs(r: Reason, _: str) -> str:
    return (
        f"{r['path']} differs from the sha256 in vLLM {r['version']}'s RECORD (edited, or not "
        f"the wheel's file); {reinstall(r)} to patch it"
    )


@words(Code.VARIANT_NOT_MADE)
def _not_made(r: Reason, _: str) -> str:
    return (
        f"variant {r['variant']} is not made yet ({r['diff']} does not exist): make it on "
        f"vLLM {r['made_on']} with `patchkit refresh {r['patch']} --variant {r['variant']} "
        "--add PATH ...` (CONTRIBUTING.md)"
    )


NEITHER = "the file is neither the pristine text this patch expects nor its patched text"


@words(Code.FILE_MISSING)
def _missing(r: Reason, _: str) -> str:
    return (
        f"variant {r['variant']}: {r['path']} is missing; the release's files are incomplete "
        "(deleted, or a partial install)"
    )


@words(Code.HUNK_MISMATCH)
def _mismatch(r: Reason, _: str) -> str:
    hunk = f"{r['path']}: hunk #{r['hunk']} ({r['header']}) {r['detail']}"
    return f"variant {r['variant']}: {hunk}; {NEITHER}"


@words(Code.NO_VARIANT_MATCHES)
def _no_match(r: Reason, _: str) -> str:
    return f"variant {r['variant']}: no variant matches; {NEITHER}"


@words(Code.BACKUP_NOT_THIS_RELEASE)
def _backup_not_here(r: Reason, _: str) -> str:
    return "its backup is not this release's file"


@words(Code.BACKUP_NOT_THIS_COMMIT)
def _backup_not_this_commit(r: Reason, _: str) -> str:
    return (
        f"a commit changed {r['path']} since the patch was applied, so its backup is another "
        f"commit's file; {reinstall(r)} and delete .patchkit/"
    )


@words(Code.APPLIED_TO_OTHER_VERSION)
def _other_version(r: Reason, _: str) -> str:
    return (
        f"the patch was applied to vLLM {r['applied_to']} and this tree reports "
        f"{r['version']}, so its backup may be another release's file; "
        f"{reinstall(r)} and delete .patchkit/"
    )


# ----- warnings and notes of a run -----


@words(Code.UNTESTED_RELEASE)
def _untested(r: Reason, _: str) -> str:
    return f"vLLM {r['version']} is not a tested release ({r['tested']}); decided by content"


@words(Code.NEWER_THAN_CATALOGUE)
def _newer(r: Reason, _: str) -> str:
    return (
        f"vLLM {r['version']} is not a tested release: it is newer than every release this "
        f"catalogue was tested on (newest {r['newest']}); decided by content; a newer patchkit "
        "may cover it, or add the release (CONTRIBUTING.md, 'A new vLLM release')"
    )


@words(Code.OUTDATED)
def _outdated(r: Reason, _: str) -> str:
    p = r["patch"]
    return (
        f"{p}: the patch file changed since it was applied (applied from an older "
        f"catalogue); `patchkit apply --only {p}` replaces it with the current one "
        f"(`patchkit revert --only {p}` takes it off)"
    )


@words(Code.OTHER_VARIANT)
def _other_variant(r: Reason, _: str) -> str:
    return (
        f"{r['patch']}: content matches variant {r['variant']}, not {r['listed']} listed for "
        f"vLLM {r['version']}"
    )


@words(Code.DECISION_EVIDENCE_MISSING)
def _no_evidence(r: Reason, _: str) -> str:
    return (
        f"{r['patch']}: the catalogue lists vLLM {r['version']} as {r['state']}, but its "
        "evidence is not in this tree"
    )


@words(Code.ONLY_NOT_APPLIED)
def _only_not_applied(r: Reason, _: str) -> str:
    return (
        f"{r['patch']} was asked for with --only but is not applied; it is {r['state']} "
        f"here: {said(r['reason'])}"
    )


@words(Code.NOT_APPLIED)
def _not_applied(r: Reason, _: str) -> str:
    return f"{r['patch']} is not applied ({r['state']})"


@words(Code.UNKNOWN_ENTRY)
def _unknown_record(r: Reason, _: str) -> str:
    return (
        f"{r['state']} records patch {r['patch']!r}, which this patchkit does not know; its "
        f"files ({', '.join(r['paths'])}) still hold what it wrote and were left alone: "
        "revert it with the patchkit that applied it, or "
        f"{reinstall(r)} and delete {r['directory']}"
    )


@words(Code.INTERRUPTED_RUN)
def _interrupted(r: Reason, _: str) -> str:
    return (
        "an earlier patchkit run was interrupted while writing; the next `patchkit apply` or "
        "`patchkit revert` rolls it back"
    )


@words(Code.INTERRUPTED_RUN_DRY)
def _interrupted_dry(r: Reason, _: str) -> str:
    return "an interrupted run will be rolled back first by a real apply"


@words(Code.CATALOGUE_INTERRUPTED)
def _catalogue_interrupted(r: Reason, _: str) -> str:
    return (
        f"a patchkit refresh was interrupted while writing the catalogue ({r['journal']}), "
        "which may hold some of its files and not others; `patchkit refresh --recover` "
        "finishes or undoes it"
    )


@words(Code.CACHES_LEFT_ALONE)
def _caches_left(r: Reason, _: str) -> str:
    return f"the caches were left alone: {r['why']}"


@words(Code.AFTER_COMMIT)
def _after_commit(r: Reason, _: str) -> str:
    doing = f"{r['doing']} of {r['patch']}" if r["patch"] else r["doing"]
    return f"the tree was changed as reported, but {doing} failed: {r['why']}"


@words(Code.BYTECODE_LEFT)
def _bytecode_left(r: Reason, _: str) -> str:
    return (
        f"the patches are in place, but stale bytecode {r['path']} could not be "
        f"removed ({r['why']}); delete it by hand (or run patchkit as the owner of the files)"
    )


@words(Code.ROLLED_BACK, Code.ROLLED_BACK_NOTHING, Code.ROLLED_BACK_COMMITTED)
def _rolled_back(r: Reason, _: str) -> str:
    if r.code == Code.ROLLED_BACK_NOTHING:
        return "an interrupted run had changed nothing; removed its journal"
    if r.code == Code.ROLLED_BACK_COMMITTED:
        return "an interrupted run had already committed; removed its journal"
    return f"rolled back an interrupted run: restored {r['path']}"


@words(Code.STALE_ENTRY)
def _stale(r: Reason, _: str) -> str:
    return (
        f"{r['patch']}: state.json's record of it no longer matches the files (vLLM was "
        "reinstalled); the next apply or revert drops it"
    )


@words(Code.DROPPED_STALE_ENTRY)
def _dropped(r: Reason, _: str) -> str:
    return f"dropped the stale record of {r['patch']} (vLLM was reinstalled since)"


@words(Code.NOT_WRITABLE)
def _not_writable(r: Reason, _: str) -> str:
    return "the tree is not writable, and nothing needed writing"


@words(Code.COMMITTED, Code.COMMITTED_REVERT)
def _committed(r: Reason, _: str) -> str:
    if r.code == Code.COMMITTED_REVERT:
        return f"committed the revert of {r['patch']} as {r['commit']}"
    return f"committed {r['patch']} as {r['commit']} on {r['branch']}"


# ----- known issues, and what to do about them -----


@words(Code.KNOWN_ISSUE, Code.KNOWN_ISSUE_UNDECIDED)
def _known_issue(r: Reason, _: str) -> str:
    text = r["text"]
    if r.code == Code.KNOWN_ISSUE_UNDECIDED:
        text = f"{untested_words.undecided(r)}: {text}"
    return f"{text}; {say(r['remedy'])}" if r["remedy"] is not None else text


@words(Code.FIXED_BY_OTHER_PATCH)
def _fixed_by_other(r: Reason, _: str) -> str:
    return f"patchkit's {r['patch']} fixes it"


@words(Code.APPLY_FIXES)
def _apply_fixes(r: Reason, _: str) -> str:
    return f"`{r['command']}` fixes it"


@words(Code.STILL_FITS)
def _still_fits(r: Reason, _: str) -> str:
    return f"{r['patch']} still fits this code: `{r['command']}` applies it"


@words(Code.NO_FIX_HERE)
def _no_fix(r: Reason, _: str) -> str:
    return f"{r['patch']} does not fit vLLM {r['version']}'s code, so patchkit has no fix here"


@words(Code.CONFLICT_STAYS)
def _conflict_stays(r: Reason, _: str) -> str:
    until = (
        f"its files are vLLM {r['version']}'s own again (`{r['reinstall_command']}`, then "
        "`patchkit apply`)"
        if r["reinstall"]
        else f"{r['patch']} has a variant for this tree's code (CONTRIBUTING.md)"
    )
    return (
        f"{r['patch']} is in conflict here, so patchkit cannot apply it (its line says what "
        f"differs): until {until}, the issue stays"
    )


# ----- refusals -----


@words(Code.REFUSED_CONFLICT)
def _refused_conflict(r: Reason, nothing: str) -> str:
    if not r["newest"]:
        reinstall = r["reinstall_command"] if r["reinstall"] else None
        way = next_words.after_conflict(r["fit"], reinstall, r["target"])
        return f"{r['patch']}: conflict: {said(r['conflict'])}; {nothing}; {way}"
    target = f"--target {r['target']}"
    after = (
        f"(vLLM {r['version']} is newer than every release this catalogue was tested on, the "
        f"newest {r['newest']}: a newer patchkit may cover it; `patchkit status {target}` "
        f"shows which patches fit, `patchkit apply --only ID {target}` applies one at your own "
        "risk; CONTRIBUTING.md, 'A new vLLM release', says how to add the release)"
    )
    return f"{r['patch']}: conflict: {said(r['conflict'])}; {nothing} {after}"


@words(Code.REFUSED_CHANGED_UPSTREAM)
def _refused_moved(r: Reason, nothing: str) -> str:
    target = f"--target {r['target']}"
    others = f" (and {', '.join(r['others'])})" if r["others"] else ""
    rest = (
        f"`{next_words.apply_only(r['fit'], r['target'])}` applies the patches that fit"
        if r["fit"]
        else f"no other patch it would take is needed here; `patchkit doctor {target}` says "
        "which known bugs stay unknown on this release until a patchkit that has decided it"
    )
    return f"{r['patch']}: changed-upstream{others}: {said(r['moved'])}; {nothing}; {rest}"


@words(Code.REFUSED_REPLACE_UNDER_LATER)
def _refused_replace_under(r: Reason, nothing: str) -> str:
    return (
        f"{r['patch']}: applied from an older catalogue, and {r['above']}, later in the "
        f"series, is applied on {r['path']}: revert it first (patchkit revert --only "
        f"{r['above']}); {nothing}"
    )


@words(Code.REFUSED_REPLACE_DOES_NOT_APPLY)
def _refused_replace(r: Reason, nothing: str) -> str:
    return (
        f"{r['patch']}: applied from an older catalogue, and the current one does not apply "
        f"to the original files ({r['state']}: {said(r['reason'])}); {nothing}"
    )


@words(Code.REFUSED_UNDER_LATER)
def _refused_under(r: Reason, nothing: str) -> str:
    return (
        f"{r['patch']}: {r['above']}, later in the series, is applied and also changes "
        f"{r['path']}; patches stack in series order, so revert it first (patchkit revert "
        f"--only {r['above']}), then apply both; {nothing}"
    )


@words(Code.REFUSED_UNKNOWN_ENTRY)
def _refused_unknown(r: Reason, nothing: str) -> str:
    return f"{say(r['entry'])}; {nothing}"


@words(Code.REFUSED_REVERT_UNDER)
def _refused_revert_under(r: Reason, nothing: str) -> str:
    above = r["above"]
    return (
        f"{r['patch']}: {above} is applied on top of it in {r['path']}; revert {above} first "
        f"(patchkit revert --only {above} --only {r['patch']}); {nothing}"
    )


@words(Code.REFUSED_REVERT_CONFLICT)
def _refused_revert_conflict(r: Reason, nothing: str) -> str:
    return f"{r['patch']}: conflict: {said(r['conflict'])}; {nothing}"


@words(Code.REFUSED_EDITED)
def _refused_edited(r: Reason, nothing: str) -> str:
    return (
        f"{r['patch']}: {headline(r['conflict'])}; revert refuses to overwrite those edits "
        f"(--force restores the original anyway and discards them); {nothing}"
    )


@words(Code.REFUSED_FORCE)
def _refused_force(r: Reason, nothing: str) -> str:
    return (
        f"{r['patch']}: {r['path']} was edited and {say(r['refusal'])}; --force never "
        f"restores a file of another release; {nothing}"
    )


@words(Code.REFUSED_BACKUP_DAMAGED)
def _refused_backup(r: Reason, nothing: str) -> str:
    return (
        f"{r['patch']}: the backup of {r['path']} is missing or damaged and reverse-applying "
        f"the diff does not give the original back; {reinstall(r)}; "
        f"{nothing}"
    )


@words(Code.REFUSED_STRICT)
def _refused_strict(r: Reason, nothing: str) -> str:
    n = r["more"]
    more = f" (and {n} more warning{'s' if n != 1 else ''})" if n > 0 else ""
    return f"--strict: {say(r['first'])}{more}; {nothing}"


@words(Code.REFUSED_HALF_WRITTEN_CATALOGUE)
def _refused_half_written(r: Reason, nothing: str) -> str:
    return (
        f"{say(r['journal'])}; {r['command']} writes nothing into a tree from a half-written "
        f"catalogue: {nothing}"
    )


@words(Code.REFUSED_READ_ONLY, Code.LOCK_NOT_CREATED)
def _refused_cause(r: Reason, nothing: str) -> str:
    return f"{say(r['cause'])}; {nothing}"


@words(Code.REFRESH_NOT_WRITTEN)
def _refresh_not_written(r: Reason, nothing: str) -> str:
    return (
        f"{say(r['cause'])}; {nothing} (refresh put the catalogue and the tree's record back as "
        "they were)"
    )


@words(Code.REFUSED_AFTER_RECOVERY)
def _after_recovery(r: Reason, _: str) -> str:
    done = "; ".join(say(d) for d in r["done"])
    return f"{say(r['cause'], NOTHING_ELSE)} (before that: {done}; that stands)"


@words(Code.CHANGED_WHILE_RUNNING)
def _changed_while_running(r: Reason, nothing: str) -> str:
    return f"{r['path']} changed while patchkit was running; {nothing} (run the command again)"


@words(Code.CHECKOUT_DIRTY)
def _dirty(r: Reason, _: str) -> str:
    changed = r["changed"]
    more = ", ..." if len(changed) > 3 else ""
    return (
        f"{r['checkout']}: the checkout has uncommitted changes ({', '.join(changed[:3])}"
        f"{more}); commit or stash them, or pass --allow-dirty"
    )


@words(Code.NO_GIT_IDENTITY)
def _no_identity(r: Reason, nothing: str) -> str:
    return (
        f"fork mode commits each patch, but git has no identity here ({r['git']}); set one: "
        "git config user.name 'Your Name' && git config user.email you@example.com (or "
        f"--global); {nothing}"
    )


@words(Code.BRANCH_ELSEWHERE)
def _branch_elsewhere(r: Reason, nothing: str) -> str:
    b = r["branch"]
    return (
        f"branch {b} exists and points at another commit than HEAD; switch to it first (git "
        f"switch {b}) and run the command there, or pass another --branch; {nothing}"
    )


@words(Code.GIT_FAILED)
def _git_failed(r: Reason, _: str) -> str:
    return (
        f"fork mode {r['command']}: git failed ({r['git']}); the branch, index and work tree "
        "are as before, nothing changed (fix what git reports, e.g. a pre-commit hook, and "
        "run the command again)"
    )


# ----- the journal, the state file -----


@words(Code.WRITE_UNDONE)
def _write_undone(r: Reason, _: str) -> str:
    return (
        f"{say(r['cause'])}; the {r['written']} file(s) already written were restored, "
        "nothing changed"
    )


@words(Code.RESTORE_FAILED)
def _restore_failed(r: Reason, _: str) -> str:
    return (
        f"restoring the tree after a failed write failed too ({say(r['cause'])}); the next "
        "`patchkit apply` or `patchkit revert` rolls the run back from its journal"
    )


@words(Code.INVALID_JOURNAL)
def _invalid_journal(r: Reason, _: str) -> str:
    return (
        f"{r['path']}: invalid journal ({r['why']}); it was not acted on; "
        f"{reinstall(r)}, then delete {r['journal']}"
    )


@words(Code.INVALID_STATE)
def _invalid_state(r: Reason, _: str) -> str:
    return (
        f"{r['path']}: invalid state file ({r['why']}); it was not acted on. If vLLM's files "
        f"are pristine, delete {r['directory']} and run `patchkit status` (patches are then "
        "recognised by content)"
    )


@words(Code.CHANGED_SINCE_INTERRUPTED)
def _changed_since_interrupted(r: Reason, _: str) -> str:
    return (
        f"{r['path']}: changed after an interrupted patchkit run, so it cannot be rolled back "
        f"safely; {reinstall(r)}, then delete "
        f"{r['journal']}"
    )


@words(Code.JOURNAL_COPY_DAMAGED)
def _journal_copy(r: Reason, _: str) -> str:
    return (
        f"{r['journal']}: the journal's copy of {r['path']} is missing or damaged; "
        f"{reinstall(r)}, then delete {r['journal']}"
    )


# ----- refresh -----


@words(Code.REFRESH_INSTALLED_CATALOGUE)
def _installed_catalogue(r: Reason, _: str) -> str:
    return (
        f"{r['catalogue']} is the catalogue installed with patchkit; refresh writes only into a "
        "catalogue in a source checkout (clone patchkit and run it from there, or set "
        "PATCHKIT_PATCHES_DIR to one)"
    )


@words(Code.REFRESH_CATALOGUE_RECOVERED)
def _catalogue_recovered(r: Reason, _: str) -> str:
    return (
        f"{say(r['recovered'])} as this refresh started: run the command again, so that it "
        "reads the catalogue as it is now (nothing else was changed)"
    )


@words(Code.REFRESH_NOT_APPLIED)
def _refresh_not_applied(r: Reason, _: str) -> str:
    p, tree = r["patch"], r["tree"]
    return (
        f"{p} is not applied on {tree}: `{next_words.apply_only([p], shlex.quote(tree))}`, "
        "edit the files, then refresh (or, to make a variant from edits of a pristine tree, "
        "name the edited files with --add)"
    )


@words(Code.REFRESH_NO_VARIANT)
def _no_variant(r: Reason, _: str) -> str:
    return f"{r['patch']} has no variant {r['variant']!r} (it has: {', '.join(r['known'])})"


@words(Code.REFRESH_UNDER_LATER)
def _refresh_under_later(r: Reason, _: str) -> str:
    return (
        f"{r['above']}, later in the series, is applied on {r['path']} too and would end up in "
        f"{r['patch']}'s diff; revert it first (patchkit revert --only {r['above']})"
    )


@words(Code.REFRESH_NOTHING_LEFT)
def _nothing_left(r: Reason, _: str) -> str:
    return (
        f"every file of {r['patch']} is back to its original: nothing left to refresh into a "
        "diff; edit the files, or revert the patch (nothing was written)"
    )


@words(Code.REFRESH_BACKUP_DAMAGED)
def _refresh_backup(r: Reason, _: str) -> str:
    return (
        f"the backup of {r['path']} is missing or damaged; refresh needs it as the original "
        f"({reinstall(r)}, apply, edit again)"
    )


@words(Code.REFRESH_SHARED_FILE)
def _shared_file(r: Reason, _: str) -> str:
    return (
        f"{r['path']} is patched by {', '.join(r['others'])} too; a file shared with other "
        "patches joins this one while they are applied, with their result as its original: "
        "apply this patch's variant first (even a partial one), then refresh"
    )


@words(Code.REFRESH_ENTRY_CHANGED)
def _record_changed(r: Reason, _: str) -> str:
    return f"{r['tree']}'s record changed while refresh ran; run it again"


@words(Code.REFRESH_NOT_PRISTINE)
def _not_pristine(r: Reason, _: str) -> str:
    return (
        f"{r['path']} is not vLLM {r['version']}'s file (RECORD); pass --pristine a pristine "
        "tree of the same release"
    )


@words(Code.REFRESH_CREATED_GONE)
def _created_gone(r: Reason, _: str) -> str:
    return f"{r['path']}, a file {r['patch']} creates, is not in the tree"


@words(Code.REFRESH_NEW_FILE)
def _new_file(r: Reason, _: str) -> str:
    return f"{r['path']} is a new file: list it in the variant's creates in {r['toml']} first"


@words(Code.REFRESH_CREATED_NOWHERE)
def _created_nowhere(r: Reason, _: str) -> str:
    return (
        f"{r['toml']}: variant {r['variant']} creates {r['path']}, but it is neither in the "
        f"tree's record of {r['patch']} nor in {r['files']}; make it in the tree and name it "
        f"with --add {r['path']}"
    )


@words(Code.REFRESH_INEXACT)
def _inexact(r: Reason, _: str) -> str:
    return (
        f"{r['path']}: a diff cannot give this file's bytes back exactly ({r['why']}); nothing "
        "was written. Give the file one kind of line ending"
    )


@words(Code.REFRESH_OUTSIDE_CATALOGUE)
def _outside(r: Reason, _: str) -> str:
    return f"{r['origin']}: {r['path']} is not inside the catalogue {r['root']}"


WORDS.update(doctor_words.WORDS)  # doctor's codes, worded in their own module
WORDS.update(runner_words.WORDS)  # the model runner's, likewise
WORDS.update(adapter_words.WORDS)  # adapter check's typed findings, likewise
WORDS.update(probe_words.WORDS)  # probe report's
WORDS.update(cache_words.WORDS)  # why a compile cache was left alone
WORDS.update(lock_words.WORDS)  # a busy lock, a bad PATCHKIT_LOCK_TIMEOUT
WORDS.update(canary_words.WORDS)  # the canary's evidence, notes, verdict and next steps
WORDS.update(verify_words.WORDS)  # why verify's verdict and reference
WORDS.update(untested_words.WORDS)  # changed-upstream, on a release the catalogue has not decided
