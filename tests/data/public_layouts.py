"""Small synthetic files in the public layouts of the shipped tabular schemas (MovieLens 1M,
Avazu, Taobao ad clicks, Yelp reviews), each with the rows preprocessing must make of it. Shared
by test_tabular and the serving tests of tabular records."""

import json
from pathlib import Path

import numpy as np

N = 300  # rows of each file, unless told


def log1p32(x):  # a dense value as preprocessing writes it: log1p of at least 0, in float32
    return np.float32(np.log1p(max(float(x), 0.0)))


def make_movielens(folder: Path, n=N, seed=0):
    """ratings.dat, users.dat, movies.dat ('::', latin-1, no header) and the expected rows.
    Users 41-45 rate but have no users.dat line (a left join: their user features are missing)."""
    rng = np.random.default_rng(seed)
    users = {
        u: [
            str(rng.choice(["F", "M"])),
            str(rng.choice([1, 18, 25, 35, 56])),
            str(rng.integers(0, 21)),
            f"{rng.integers(10000, 99999)}",
        ]
        for u in range(1, 41)
    }
    genres = ["Action", "Comedy", "Drama", "Children's", "Film-Noir"]
    movies = {
        m: [
            f"Movie {m}: Part {m % 3} ({1960 + m})" if m != 7 else "Café Society (1999)",
            "|".join(rng.choice(genres, rng.integers(1, 3), replace=False)),
        ]
        for m in range(1, 31)
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "users.dat").write_bytes("".join(f"{u}::{'::'.join(v)}\n" for u, v in users.items()).encode("latin-1"))
    (folder / "movies.dat").write_bytes("".join(f"{m}::{'::'.join(v)}\n" for m, v in movies.items()).encode("latin-1"))
    want = {"labels": [], "dense": [], "cats": []}
    lines = []
    for i in range(n):
        u, m, r = int(rng.integers(1, 46)), int(rng.integers(1, 31)), int(rng.integers(1, 6))
        lines.append(f"{u}::{m}::{r}::{978300000 + 7 * i}\n")
        want["labels"].append(int(r >= 4))
        want["dense"].append([])
        want["cats"].append([str(u), str(m), *users.get(u, [None] * 4), movies[m][1]])
    (folder / "ratings.dat").write_bytes("".join(lines).encode("latin-1"))
    return want


AVAZU_HEADER = (
    "id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,app_category,"
    "device_id,device_ip,device_model,device_type,device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21"
)


def make_avazu(path: Path, n=N, seed=1):
    """train.csv with its header; hour YYMMDDHH in time order; every column categorical."""
    rng = np.random.default_rng(seed)
    pool = lambda k: [f"{v:08x}" for v in rng.integers(0, 2**32, k)]
    sites, apps, models = pool(12), pool(8), pool(20)
    lines, want = [AVAZU_HEADER + "\n"], {"labels": [], "dense": [], "cats": []}
    for i in range(n):
        hour = f"1410{21 + i * 10 // n:02d}{i % 24:02d}"
        click = int(rng.random() < 0.2)
        fields = [
            f"{rng.integers(10**17, 10**18)}7",
            str(click),
            hour,
            str(rng.choice([1005, 1002, 1010])),
            str(rng.choice([0, 1, 7])),
            rng.choice(sites),
            rng.choice(sites),
            rng.choice(sites),
            rng.choice(apps),
            rng.choice(apps),
            rng.choice(apps),
            rng.choice(["a99f214a", *pool(3)]),
            pool(1)[0],
            rng.choice(models),
            str(rng.integers(0, 5)),
            str(rng.integers(0, 4)),
            *[str(rng.integers(0, 30)) for _ in range(8)],
        ]
        lines.append(",".join(fields) + "\n")
        want["labels"].append(click)
        want["dense"].append([])
        want["cats"].append([hour[6:8], *fields[3:]])
    path.write_text("".join(lines))
    return want


def make_taobao(folder: Path, n=N, seed=2):
    """raw_sample.csv, ad_feature.csv, user_profile.csv with their headers. Users 41-50 have no
    profile; adgroup 99 has no ad_feature line; brand is "NULL" or pvalue_level empty at times."""
    rng = np.random.default_rng(seed)
    ads = {
        a: [
            str(rng.integers(1, 9)),
            str(rng.integers(100, 120)),
            str(rng.integers(1000, 1010)),
            "NULL" if a % 5 == 0 else str(rng.integers(5000, 5010)),
            f"{rng.choice([0.01, 9.9, 118.0, 2e5])}",
        ]
        for a in range(1, 31)
    }
    users = {
        u: [
            str(rng.integers(0, 97)),
            str(rng.integers(0, 13)),
            str(rng.integers(1, 3)),
            str(rng.integers(0, 7)),
            "" if u % 4 == 0 else str(rng.integers(1, 4)),
            str(rng.integers(1, 4)),
            str(rng.integers(0, 2)),
            str(rng.integers(1, 5)),
        ]
        for u in range(1, 41)
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ad_feature.csv").write_text(
        "adgroup_id,cate_id,campaign_id,customer,brand,price\n"
        + "".join(f"{a},{','.join(v)}\n" for a, v in ads.items())
    )
    (folder / "user_profile.csv").write_text(
        "userid,cms_segid,cms_group_id,final_gender_code,age_level,pvalue_level,shopping_level,occupation,"
        "new_user_class_level \n" + "".join(f"{u},{','.join(v)}\n" for u, v in users.items())
    )
    lines, want = ["user,time_stamp,adgroup_id,pid,nonclk,clk\n"], {"labels": [], "dense": [], "cats": []}
    for i in range(n):
        u, a, clk = int(rng.integers(1, 51)), int(rng.choice([*range(1, 31), 99])), int(rng.random() < 0.1)
        pid = str(rng.choice(["430548_1007", "430539_1007"]))
        lines.append(f"{u},{1494000000 + i},{a},{pid},{1 - clk},{clk}\n")
        ad = ads.get(a, [None] * 5)
        want["labels"].append(clk)
        want["dense"].append([log1p32(ad[4]) if ad[4] else 0.0])
        brand = None if ad[3] == "NULL" else ad[3]
        want["cats"].append([str(u), str(a), pid, *ad[:3], brand, *users.get(u, [None] * 8)])
    (folder / "raw_sample.csv").write_text("".join(lines))
    return want


def make_yelp(path: Path, n=N, seed=3):
    """yelp_academic_dataset_review.json: one JSON object a line; stars int or float."""
    rng = np.random.default_rng(seed)
    uids, bids = (
        [f"u{v:021x}"[:22] for v in rng.integers(0, 2**60, 25)],
        [f"b-{v:x}" for v in rng.integers(0, 2**40, 15)],
    )
    lines, want = [], {"labels": [], "dense": [], "cats": []}
    for i in range(n):
        stars = [1, 2, 3, 4, 5, 4.0, 5.0, 4.5][int(rng.integers(0, 8))]
        votes = [int(v) for v in rng.integers(0, 50, 3) * (rng.random(3) < 0.5)]
        date = str(np.datetime64("2010-01-01T12:34:56") + np.timedelta64(13 * i, "D") + np.timedelta64(i, "s"))
        date = date.replace("T", " ")  # in time order, as split_by: date then keeps the tail
        review = {
            "review_id": f"r{i:021d}",
            "user_id": str(rng.choice(uids)),
            "business_id": str(rng.choice(bids)),
            "stars": stars,
            "useful": votes[0],
            "funny": votes[1],
            "cool": votes[2],
            "text": 'Great, "really"\nnice, café ☕',
            "date": date,
        }
        lines.append(json.dumps(review, ensure_ascii=i % 2 == 0) + "\n")
        want["labels"].append(int(stars > 4))
        want["dense"].append([log1p32(v) for v in votes])
        want["cats"].append([review["user_id"], review["business_id"], date[:4], date[5:7]])
    path.write_text("".join(lines), encoding="utf-8")
    return want
