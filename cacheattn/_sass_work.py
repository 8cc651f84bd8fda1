"""The committed sm_90 SASS figures the kernel plan weighs (`cacheattn.lab.sass.plan_work`), written by
`python -m cacheattn.lab.sass --write docs/kernel-ladder-sass.json`: do not edit by hand."""

SASS_WORK = {
    (3, 'decode', 0): (517, 1245, 2, 29, 1, 5, 4),
    (3, 'decode', 4): (863, 1968, 2, 21, 0, 6, 2),
    (3, 'decode', 8): (868, 1968, 2, 21, 2, 2, 2),
    (3, 'prefill', 0): (725, 1792, 2, 41, 1, 5, 2),
    (4, 'decode', 0): (526, 1317, 2, 29, 1, 5, 3),
    (4, 'decode', 4): (863, 2080, 2, 21, 0, 6, 2),
    (4, 'decode', 8): (868, 2079, 2, 21, 1, 5, 2),
    (4, 'prefill', 0): (729, 1927, 2, 41, 1, 5, 2),
    (5, 'decode', 0): (233, 1539, 5, 8, 2, 1, 3),
    (5, 'decode', 4): (419, 1747, 5, 8, 1, 2, 4),
    (5, 'decode', 8): (452, 1812, 5, 10, 2, 1, 3),
    (5, 'prefill', 0): (1730, 3622, 10, 84, 4, 28, 2),
    (5, 'prefill', 4): (2607, 2181, 10, 148, 3, 27, 2),
    (5, 'prefill', 8): (1961, 3597, 10, 92, 3, 27, 2),
    (6, 'prefill', 0): (634, 2630, 34, 20, 2, 1, 2),
}
