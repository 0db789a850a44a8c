from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [
        migrations.CreateModel(
            name="Item",
            fields=[
                ("id", models.CharField(max_length=100, primary_key=True, serialize=False)),
                ("series", models.CharField(db_index=True, max_length=64)),
            ],
            options={"db_table": "dw_items"},
        ),
    ]
